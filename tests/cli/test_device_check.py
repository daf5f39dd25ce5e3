"""bench/device_check.sh runs only where a GPU is lent: its model flags, its `plan` command, its
`train` command lines (JAX and torch) and its wrap bench line are checked here so the script does
not rot between lendings, the plan's H200 prediction that docs/plan.md quotes is the planner's,
the kernel stage (bench/gpu_kernels.py) runs its dry run on this CPU, and the table reads what
the stages write."""
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

from trainspec.cli.main import build_parser, main
from trainspec.core.plan.transformer import parameters
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "bench" / "device_check.sh").read_text()


def _model_flags() -> list[str]:
    block = re.search(r"^MODEL=\((.*?)\)$", SCRIPT, re.S | re.M)
    assert block, "bench/device_check.sh: no MODEL=(...) array"
    return shlex.split(block.group(1))


def _array(name: str) -> list[str]:
    """The words of the script's first `NAME=(...)` assignment."""
    found = re.search(rf"\b{name}=\((.*?)\)", SCRIPT)
    assert found, f"bench/device_check.sh: no {name}=(...)"
    return shlex.split(found.group(1))


def _command(verb: str, after: str = "$TS") -> list[str]:
    """The script's `<after> <verb> ...` line as argv (up to its redirection), its shell
    variables given the values they have on a GPU."""
    lines = SCRIPT.replace("\\\n", " ").splitlines()  # continuation lines joined
    line = next(l for l in lines if after + " " + verb in l)
    words = shlex.split(line.split(after, 1)[1].split(">")[0].replace('"${MODEL[@]}"', "MODEL"))
    values = {"${HW:-cpu}": "h200", "$STEPS": "30", "$OUT/plan.json": "plan.json"}
    argv = []
    for word in words:
        if word == "MODEL":
            argv += _model_flags()
        elif word.startswith("${") and word.endswith("[@]}"):  # KERNELS, HOST, WRAP
            argv += _array(word[2:-4])
        else:
            argv += [values.get(word, word)]
    return argv


def test_the_model_is_a_valid_spec_of_about_350m_parameters():
    sets = [v for k, v in zip(_model_flags(), _model_flags()[1:]) if k == "--set"]
    spec = load_spec(DEFAULT_SPEC_PATH, sets)
    assert (spec.model.n_layers, spec.model.d_model, spec.precision.compute) == (28, 1024, "bfloat16")
    assert sum(p.size for p in parameters(spec.model)) == pytest.approx(350e6, rel=0.02)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_the_train_command_lines_parse(framework):
    words = _command("train" if framework == "jax" else "train --framework")
    args = build_parser().parse_args(words)
    assert (args.command, args.steps, args.quiet, args.framework) == ("train", 30, True, framework)


def test_the_plan_command_runs_and_predicts_what_the_docs_quote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(_command("plan")) == 0
    predicted = json.loads((tmp_path / "plan.json").read_text())["predictions"][0]
    docs = (ROOT / "docs" / "plan.md").read_text()
    quoted = re.search(r"is ([\d.]+) GB per device .*?([\d.]+) ms per step, MFU ([\d.]+)%",
                       docs, re.S)
    assert quoted, "docs/plan.md: the GPU check's quoted prediction is gone"
    gb, ms, mfu = map(float, quoted.groups())
    assert predicted["memory"]["total"] / 1e9 == pytest.approx(gb, abs=0.005)
    assert predicted["step_time_s"] * 1e3 == pytest.approx(ms, abs=0.05)
    assert predicted["mfu"] * 100 == pytest.approx(mfu, abs=0.05)


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_wrap_bench_command_line_parses():
    words = _command("", after="bench/wrap_overhead.py")
    args = _bench("wrap_overhead").build_parser().parse_args(words)
    assert (args.devices, args.rounds, args.steps) == ([1], 10, 10)


def test_the_kernel_stage_dry_run_matches_numpy_and_feeds_the_table(tmp_path, capsys):
    """bench/gpu_kernels.py's dry run, here on the CPU handlers: every kernel family against
    NumPy bit for bit, then the table renders its rows with the other stages' outputs."""
    words = _command("", after="bench/gpu_kernels.py")
    assert words[:2] == ["--json", "$OUT/kernels.json"]
    assert _bench("gpu_kernels").main(["--json", str(tmp_path / "kernels.json"), "--dry-run"]) == 0
    (tmp_path / "summary.json").write_text(json.dumps({"mfu": 0.52, "step_time_s": 0.5}))
    (tmp_path / "wrap.txt").write_text(
        "  wall plain jit   100.00 ms/step\n       wrap      101.00 ms/step  /plain: median of "
        "pairs 1.010x (90% interval 1.000 .. 1.020; pairs 0.990 .. 1.030)\n")
    capsys.readouterr()
    assert _bench("device_check_table").main([str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    kernel_rows = [r for r in table if "vs NumPy" in r]
    assert len(kernel_rows) == 9 and all(r.rstrip().endswith("| yes") for r in kernel_rows)
    assert any("JAX train" in r and "MFU 52.0%" in r and r.rstrip().endswith("yes") for r in table)
    assert any("torch train" in r and "no result" in r for r in table)
    assert any("wrap overhead: wrap" in r and "1.010x" in r for r in table)
