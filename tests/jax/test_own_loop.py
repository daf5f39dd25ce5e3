"""A user's own model and loop get the run services of `trainspec train`:
`trainspec train --model examples/own_model.py:make` trains a model that is not the reference
job; an own JAX loop through `trainspec.jax.Run` writes schema-valid metrics.jsonl and
checkpoints and resumes them (the CLI's as well as its own) to the uninterrupted losses, bit for
bit; `trainspec validate --model` shows the user's layout; a bad --model is one line."""
import importlib.util
import re
from pathlib import Path

import jax
import jsonschema
import pytest

from run_dirs import recorded_losses
from tiny import LAYOUTS, TINY, tiny_spec
from trainspec.cli.main import main
from trainspec.core.records import json_schema, read_jsonl
from trainspec.core.spec import load_spec
from trainspec.core.user_model import spec_for
from trainspec.jax import Run, loss_step, wrap

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "examples" / "own_model.py"
MODEL = f"{FILE}:make"
_found = importlib.util.spec_from_file_location("own_model", FILE)
own_model = importlib.util.module_from_spec(_found)
_found.loader.exec_module(own_model)
FEATURES, HIDDEN = own_model.FEATURES, own_model.HIDDEN
SETS = ["checkpoint.interval=2", "checkpoint.keep=2", "checkpoint.async_save=false",
        "metrics.interval=2", "batch.micro_batch=8"]  # two micro-batches per step
LAYOUT = "fsdp2"
CLI_SETS = [a for s in [*TINY, *LAYOUTS[LAYOUT], *SETS] for a in ("--set", s)]


def _spec():
    return tiny_spec(*SETS, layout=LAYOUT)


def _own_loop(run_dir, steps, announce=None):
    """The loop docs/wrapping.md shows, around the user's loss and data."""
    model = own_model.make(_spec())
    spec = spec_for(_spec(), model)  # rows without sequences: one token each
    step = wrap(loss_step(model.loss), spec)
    with Run(spec, run_dir, step, steps, model_flops=model.model_flops(spec),
             schedule=model.schedule, progress=False, announce=announce) as run:
        state = run.resume(model.init, jax.random.key(spec.seed))
        for batch in run.batches(model.batches):
            state, metrics = step(state, batch)
            state = run.after_step(state, metrics)
    return run.summary()


def test_resume_without_init_fn_names_it(tmp_path):
    """The trunk's one signature, `resume(init_fn=None, *args)`: JAX plans the state's layout
    from init_fn, so it is required, and its absence is said before anything is built."""
    spec = _spec()
    step = wrap(loss_step(own_model.make(spec).loss), spec)
    with Run(spec, tmp_path, step, 2, progress=False) as run:
        with pytest.raises(TypeError, match="init_fn is required"):
            run.resume()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("own")
    return run_dir, _own_loop(run_dir, 6)


def test_an_own_loop_writes_records_checkpoints_and_a_summary(uninterrupted):
    run_dir, summary = uninterrupted
    records = read_jsonl(run_dir)
    schema = json_schema()
    for record in records:
        jsonschema.validate(record, schema)
    assert [r["step"] for r in records] == [1, 2, 4, 6]
    assert [r["step"] for r in records if r.get("checkpoint_saved")] == [2, 4, 6]
    assert all(r["learning_rate"] == 3e-2 and r["framework"] == "jax" for r in records)
    # the loss's aux, summed over the 2 micro-batches, reaches the records: |error| summed
    # over 16 rows is at least sqrt(loss sum) = sqrt(16 x the mean loss)
    for r in records:
        assert r["aux"]["abs_error_sum"] >= (16 * r["loss"]) ** 0.5 > 0
    flops = 6 * (FEATURES * HIDDEN + HIDDEN) * 16  # per row x 16 rows a step
    assert {r["model_flops_per_step"] for r in records} == {flops} and records[-1]["mfu"] > 0
    assert {r["batch_tokens"] for r in records} == {16}  # its 16 rows, not rows x a seq_len
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [4, 6]  # keep 2
    assert summary["mesh"] == {"data": 4, "fsdp": 2, "tensor": 1}
    assert summary["accumulation_steps"] == 2 and summary["last_checkpoint"] == 6
    assert summary["final_loss"] < summary["initial_loss"]


def test_the_cli_trains_the_model_and_an_own_loop_resumes_it_bitwise(uninterrupted, tmp_path,
                                                                    capsys):
    reference, _ = uninterrupted
    code = main(["train", "--quiet", "--model", MODEL, "--steps", "4", "--run-dir",
                 str(tmp_path), *CLI_SETS])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "trained 4 steps on mesh data=4 x fsdp=2 x tensor=1 (2 micro-batches per step)" in out
    assert {r["batch_tokens"] for r in read_jsonl(tmp_path)} == {16}  # rows, no invented length
    assert load_spec(tmp_path / "spec.toml").batch.seq_len == 1
    said = []
    summary = _own_loop(tmp_path, 6, announce=said.append)
    assert said == ["resumed from step 4 (mesh data=4 x fsdp=2 x tensor=1 → "
                    "data=4 x fsdp=2 x tensor=1, unchanged)"]
    assert summary["resumed_from"] == 4
    want, got = recorded_losses(reference), recorded_losses(tmp_path)
    assert sorted(got) == [1, 2, 4, 5, 6]  # the first step after a resume is recorded too
    assert {step: got[step] for step in want} == want  # bit for bit


def test_validate_shows_the_users_layout(capsys):
    assert main(["validate", str(ROOT / "trainspec" / "default.toml"),
                 "--model", MODEL, *CLI_SETS]) == 0
    out = capsys.readouterr().out
    assert "mesh: data=4 x fsdp=2 x tensor=1" in out
    # the MLP's first kernel, named (embed, mlp): split over fsdp by the default rules
    assert re.search(rf"\.params\['Dense_0'\]\['kernel'\] +\({FEATURES}, {HIDDEN}\) +"
                     r"P\('fsdp', None\)", out), out


@pytest.mark.parametrize("reference,says", [
    ("no_such_file.py:make", "--model: no such file no_such_file.py"),
    (f"{FILE}:unmade", "has no function 'unmade'"),
    (str(FILE), "--model: expected MODULE:FUNCTION"),
    ("builtins:repr", "--model: builtins:repr returned str, expected a"),
])
def test_a_bad_model_is_one_line(tmp_path, capsys, reference, says):
    code = main(["train", "--quiet", "--model", reference, "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and says in err[-1] and err[-1].startswith("trainspec: error: --model")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_torch_layout_on_a_jax_model_is_one_line(tmp_path, capsys):
    (tmp_path / "planned.py").write_text(
        f"import importlib.util\nspec = importlib.util.spec_from_file_location('m', {str(FILE)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "import dataclasses\n"
        "def make(s):\n    return dataclasses.replace(m.make(s), fsdp_units=['blocks.*'])\n")
    code = main(["train", "--quiet", "--model", f"{tmp_path / 'planned.py'}:make",
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["trainspec: error: --model: tensor_plan and fsdp_units name "
                                 "torch modules; on JAX the spec's layout.rules split a model "
                                 "by its logical axis names"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
