"""bench/device_check.sh runs only where a GPU is lent: its model flags, its `plan` command, its
`train` command line and its wrap bench line are checked here so the script does not rot
between lendings, and the plan's H200 prediction that docs/plan.md quotes is the planner's."""
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


def _command(verb: str) -> list[str]:
    """The script's `$TS <verb> ...` line as argv, its shell variables given test values."""
    lines = SCRIPT.replace("\\\n", " ").splitlines()  # continuation lines joined
    line = next(l for l in lines if re.search(rf"\$TS {verb}\b", l))
    words = shlex.split(line.split("$TS", 1)[1].split("|")[0].replace('"${MODEL[@]}"', "MODEL"))
    values = {"$HW": "h200", "$OUT/plan.json": "plan.json", "$OUT/run": "run",
              "$OUT/summary.json": "summary.json"}
    argv = []
    for word in words:
        argv += _model_flags() if word == "MODEL" else [values.get(word, word)]
    return argv


def test_the_model_is_a_valid_spec_of_about_127m_parameters():
    sets = [v for k, v in zip(_model_flags(), _model_flags()[1:]) if k == "--set"]
    spec = load_spec(DEFAULT_SPEC_PATH, sets)
    assert (spec.model.n_layers, spec.model.d_model, spec.precision.compute) == (18, 768, "bfloat16")
    assert sum(p.size for p in parameters(spec.model)) == pytest.approx(127e6, rel=0.02)


def test_the_train_command_line_parses():
    args = build_parser().parse_args(_command("train"))
    assert (args.command, args.steps, args.quiet) == ("train", 60, True)


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


def test_the_wrap_bench_command_line_parses():
    line = next(l for l in SCRIPT.splitlines()
                if l.startswith("timeout") and "bench/wrap_overhead.py" in l)
    words = shlex.split(line.split("bench/wrap_overhead.py", 1)[1].split("|")[0])
    spec = importlib.util.spec_from_file_location("wrap_overhead",
                                                  ROOT / "bench" / "wrap_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.build_parser().parse_args(words)
    assert (args.devices, args.rounds, args.steps) == ([1], 15, 20)
