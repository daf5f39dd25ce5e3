"""The capability table (trainspec/core/capabilities.py): every field of the schema and every
flag of `trainspec train` is declared by each implementation, a field added without an entry
is found, a refused value is one line naming the field, and docs/adapters.md shows the table
the code declares."""
import re
from pathlib import Path

import pytest
from pydantic import Field

from trainspec.cli.conformance import capability_markdown, count_markdown, train_flags
from trainspec.cli.main import main
from trainspec.core.capabilities import Request, schema_fields, undeclared
from trainspec.core.errors import UserInputError
from trainspec.core.mesh import ParallelDims
from trainspec.core.spec import MetricsSpec, Spec
from trainspec.jax.capabilities import JAX
from trainspec.torch.capabilities import TORCH
from trainspec.torch.support import check_layout, check_run, check_spec
from tiny import tiny_spec

ROOT = Path(__file__).resolve().parents[2]
TABLES = [JAX, TORCH]


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.implementation)
def test_every_field_and_flag_is_declared_and_nothing_else(table):
    fields = [*schema_fields(), *train_flags()]
    assert undeclared(table, fields) == []
    # no entry for a field that went (sections refused whole have one)
    assert set(table.entries) - set(fields) <= {"semi_sync", "model.moe"}


def test_the_walk_reports_a_field_added_without_an_entry():
    """A copy of the schema with one new top-level field and one new field in a section: the
    walk finds both, and every implementation's table is missing them."""

    class MetricsPlus(MetricsSpec):
        trace_every: int = Field(0, description="a field nobody declared")

    class SpecPlus(Spec):
        new_switch: bool = False
        metrics: MetricsPlus = MetricsPlus()

    fields = schema_fields(SpecPlus)
    assert {"new_switch", "metrics.trace_every"} <= set(fields)
    for table in TABLES:
        assert undeclared(table, fields) == ["metrics.trace_every", "new_switch"]


def test_keyed_sections_and_optional_sections_are_walked():
    fields = schema_fields()
    assert {"mesh.axes.*.size", "mesh.axes.*.role", "semi_sync.outer_lr"} <= set(fields)
    assert not any(f in fields for f in ("mesh.axes", "semi_sync", "health.nan"))


def test_refusing_flags_are_named_as_their_destinations():
    """given_flags keys a flag by its argparse destination: a refusing entry for a flag whose
    destination is another name would never see its value."""
    from trainspec.cli.train_spec import given_flags
    from trainspec.cli.main import build_parser

    args = build_parser().parse_args(["train"])
    for table in TABLES:
        for flag, entry in table.entries.items():
            if flag.startswith("--") and entry.refusals:
                assert flag in given_flags(args), (table.implementation, flag)


@pytest.mark.parametrize("sets,field", [
    (["semi_sync.inner_steps=4", 'collectives.compression="int8"'], "semi_sync.inner_steps"),
    (["mesh.axes.tensor.size=2", "model.n_heads=3", "model.d_model=33"], "model.n_heads"),
    (["mesh.axes.data.size=1", "mesh.axes.fsdp.size=-1", "metrics.gns=true"], "metrics.gns"),
])
def test_torch_refuses_what_it_does_not_do_in_one_line_naming_the_field(sets, field):
    spec = tiny_spec("checkpoint.interval=0", *sets)
    with pytest.raises(UserInputError) as refused:
        check_run(spec, 4)
    assert str(refused.value).startswith(f"{field}: ") and "\n" not in str(refused.value)


def test_torch_runs_what_it_honours():
    check_run(tiny_spec("mesh.axes.fsdp.size=2", "metrics.tensorboard=true",
                        "health.preflight=true"), 4,
              {"--restart": True, "--model": "own.py:make", "--exclude-devices": [1]})
    check_run(tiny_spec("checkpoint.interval=0"), 1)  # one rank: no replicas to compare


def test_a_step_checks_the_fields_a_step_depends_on():
    """TorchStep and wrap check the step's fields (check_spec, check_layout); the flags of
    `trainspec train` are the run's (check_run)."""
    spec = tiny_spec()
    check_spec(spec, 4)
    assert check_layout(spec, 4).shape == {"data": 4, "fsdp": 1, "tensor": 1}
    with pytest.raises(UserInputError, match="^--host-devices: "):
        check_run(spec, 4, {"--host-devices": 2})
    with pytest.raises(UserInputError, match="^layout.rules: the torch implementation lays"):
        check_layout(tiny_spec("layout.rules.embed=[]"), 4)


def test_the_refusal_line_names_the_values():
    spec = tiny_spec("mesh.axes.tensor.size=2", "model.n_heads=3", "model.d_model=33")
    lines = TORCH.refusals(Request(spec, ParallelDims.of(spec, {"data": 2, "fsdp": 1, "tensor": 2})))
    assert "model.n_heads: 3 is not divisible by the 2 ranks of tensor axis 'tensor'" in lines


@pytest.mark.parametrize("argv,flag", [
    (["--framework", "torch", "--host-devices", "2"], "--host-devices"),
    (["--nprocs", "2"], "--nprocs"),
])
def test_a_refused_flag_is_one_line_before_anything_starts(tmp_path, capsys, argv, flag):
    assert main(["train", "--run-dir", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"trainspec: error: {flag}: ") and "\n" not in err, err
    assert not (tmp_path / "run").exists()


def _generated(name: str, end: str) -> str:
    text = (ROOT / "docs" / "adapters.md").read_text()
    block = re.search(rf"<!-- {name} -->\n(.*?)<!-- end of {end} -->", text, re.S)
    assert block, f"docs/adapters.md has no generated {end}"
    return block.group(1)


def test_the_docs_show_the_table_the_code_declares():
    assert _generated("capability table: trainspec conformance --capabilities",
                      "the capability table") == capability_markdown(), (
        "docs/adapters.md is stale: paste the output of `trainspec conformance --capabilities`")


def test_the_docs_show_the_suite_s_case_counts():
    pytest.importorskip("torch", reason="counting torch's cases needs the torch extra")
    assert _generated("case counts: trainspec conformance --count",
                      "the case counts") == count_markdown(), (
        "docs/adapters.md is stale: paste the output of `trainspec conformance --count`")


def test_the_docs_give_the_third_implementation_s_line_count():
    text = (ROOT / "docs" / "adapters.md").read_text()
    stated = re.search(r"numpy_impl.py as the example \(.*?; (\d+) lines\)", text, re.S)
    lines = (ROOT / "tests" / "conformance" / "numpy_impl.py").read_text().count("\n")
    assert stated and int(stated.group(1)) == lines, (stated and stated.group(1), lines)
