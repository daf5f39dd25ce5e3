"""Inputs that a real run cannot run, each one line naming the field or argument, exit 2, no
traceback, nothing written: the spec's bounds, a mesh axis name XLA cannot take, a model too
large for the host (refused before it takes memory), `--model` code that fails in any way
(before any rank starts), records of the wrong types, a calibration file that is not one."""
import json
import time

import pytest

from trainspec.cli.main import main

DEFAULT = "trainspec/default.toml"
BIG = 2**70


def _one_line(capsys, code, expected):
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainspec: error: "), err
    assert expected in lines[0], lines[0]
    return lines[0]


SPEC_CASES = [
    ("axis name データ", ['mesh.axes.データ.size=1', 'mesh.axes.データ.role="data"'],
     "axis name 'データ' is not an ASCII identifier"),
    ("axis name é", ['mesh.axes.é.size=1', 'mesh.axes.é.role="data"'], "axis name 'é'"),
    ("steps 2**63-1", [f"train.steps={2**63 - 1}"], "field 'train.steps'"),
    ("checkpoint interval 1e20", ["checkpoint.interval=100000000000000000000"],
     "field 'checkpoint.interval'"),
    ("checkpoint interval 1e20 float", ["checkpoint.interval=1e20"], "checkpoint.interval"),
    ("timeout 1e300", ["collectives.timeout_s=1e300"], "field 'collectives.timeout_s'"),
    ("checkpoint dir empty", ['checkpoint.dir=""'], "field 'checkpoint.dir'"),
    ("checkpoint dir dot", ['checkpoint.dir="."'], "field 'checkpoint.dir'"),
    ("checkpoint dir outside", ['checkpoint.dir="../elsewhere"'], "field 'checkpoint.dir'"),
    ("checkpoint dir absolute", ['checkpoint.dir="/tmp/x"'], "field 'checkpoint.dir'"),
    ("metrics path empty", ['metrics.path=""'], "field 'metrics.path'"),
    ("metrics interval huge", [f"metrics.interval={BIG}"], "field 'metrics.interval'"),
    ("warmup huge", [f"optimizer.warmup_steps={10**12}"], "optimizer.warmup_steps"),
    ("keep huge", [f"checkpoint.keep={10**12}"], "field 'checkpoint.keep'"),
    ("fingerprint interval huge", [f"health.fingerprints.interval={10**12}"],
     "health.fingerprints.interval"),
    ("mesh size huge", [f"mesh.axes.fsdp.size={2**40}"], "mesh.axes.fsdp.size"),
    ("excluded device negative", ["mesh.exclude_devices=[-1]"], "mesh.exclude_devices"),
    ("d_model = d_ff = 2**20", ["model.d_model=1048576", "model.d_ff=1048576",
                                "model.n_heads=1"], "field 'model.d_model'"),
    ("n_layers 4096", ["model.n_layers=4096"], "field 'model.n_layers'"),
    ("too many parameters", ["model.d_model=131072", "model.d_ff=131072", "model.n_heads=1",
                             "model.n_layers=256"], "parameters, more than 1e+13"),
]


@pytest.mark.parametrize("sets,expected", [c[1:] for c in SPEC_CASES],
                         ids=[c[0] for c in SPEC_CASES])
def test_validate_refuses_what_no_run_can_reach(capsys, sets, expected):
    t0 = time.monotonic()
    code = main(["validate", DEFAULT, *[a for s in sets for a in ("--set", s)]])
    _one_line(capsys, code, expected)
    assert time.monotonic() - t0 < 10  # refused before the model is built


TRAIN_CASES = [
    ("steps 2**70", ["--steps", str(BIG)], "--steps: expected at most 1000000000"),
    ("empty device id", ["--exclude-devices", "1,,2"], "--exclude-devices"),
    ("host devices 100000", ["--host-devices", "100000"], "--host-devices: expected 1 to 1024"),
    ("a sink not installed", ["--set", 'metrics.sinks=["not-installed"]'],
     "metrics.sinks: no sink 'not-installed' is installed"),
    ("a model larger than the host", ["--set", "model.d_model=131072", "--set",
                                      "model.d_ff=131072", "--set", "model.n_heads=1"],
     "model.d_model, model.d_ff, model.n_layers and model.vocab_size: the model's 2.06e+11 "
     "parameters need at least"),
]


@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("argv,expected", [c[1:] for c in TRAIN_CASES],
                         ids=[c[0] for c in TRAIN_CASES])
def test_train_refuses_before_anything_is_written(tmp_path, capsys, framework, argv, expected):
    if framework == "torch" and argv[0] == "--host-devices":
        expected = "--host-devices"  # a JAX flag: refused as such on torch
    code = main(["train", "--framework", framework, "--run-dir", str(tmp_path / "run"), *argv])
    _one_line(capsys, code, expected)
    assert not (tmp_path / "run").exists()


MODELS = {
    "raises": ("def make(spec):\n    raise ValueError('no data here')\n",
               "make raised ValueError: no data here ({path}:2)"),
    "syntax": ("def make(spec)\n    return 1\n",
               "failed: SyntaxError: expected ':' ({path}:1)"),
    "signature": ("def make(spec, extra):\n    return None\n",
                  "make takes (spec, extra); expected one argument, the spec"),
    "import": ("import not_a_module_anywhere\ndef make(spec):\n    return None\n",
               "failed: ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
    "returns": ("def make(spec):\n    return 3\n", "make returned int, expected a"),
    "int init": ("import numpy as np\nfrom trainspec.core.user_model import UserModel\n"
                 "def make(spec):\n    return UserModel(lambda *a: 3, lambda *a: 0, "
                 "lambda i: {})\n", "init"),
}


@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("case", list(MODELS))
def test_a_failing_model_file_is_one_line_before_any_rank(tmp_path, capsys, framework, case):
    source, expected = MODELS[case]
    path = tmp_path / "model.py"
    path.write_text(source)
    if case == "int init":
        expected = ("init(rng) returned an array of shape ()" if framework == "jax"
                    else "init() returned int")
    code = main(["train", "--framework", framework, "--model", f"{path}:make", "--run-dir",
                 str(tmp_path / "run")])
    line = _one_line(capsys, code, expected.format(path=path))
    assert line.startswith("trainspec: error: --model: ")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize("framework,other", [("jax", "examples/own_torch_model.py"),
                                             ("torch", "examples/own_model.py")])
def test_a_model_of_the_other_framework_is_one_line(tmp_path, capsys, framework, other,
                                                    command):
    """`train` refuses it before any rank starts (torch's 4 ranks each said it, 165 lines)."""
    where = [DEFAULT] if command == "validate" else ["--run-dir", str(tmp_path / "run")]
    code = main([command, *where, "--framework", framework, "--model", f"{other}:make"])
    line = _one_line(capsys, code, "--model: init")
    assert ("--framework torch" if framework == "jax" else "--framework jax") in line
    assert not (tmp_path / "run").exists()


def test_a_model_file_imports_the_modules_beside_it(tmp_path, capsys):
    (tmp_path / "helper_beside.py").write_text("HIDDEN = 'found'\n")
    (tmp_path / "model.py").write_text(
        "import helper_beside\ndef make(spec):\n    raise RuntimeError(helper_beside.HIDDEN)\n")
    code = main(["validate", DEFAULT, "--model", f"{tmp_path / 'model.py'}:make"])
    _one_line(capsys, code, "raised RuntimeError: found")  # imported: the function ran


def _record(tmp_path):
    from trainspec.core.records import FIELDS, SCHEMA_ID

    record = {name: None for name in FIELDS}
    record.update(schema=SCHEMA_ID, step=1, steps_in_interval=1, time=1.0, loss=1.0)
    return record


@pytest.mark.parametrize("change,expected", [
    ({"step_time_s": "fast"}, "field 'step_time_s' is str"),
    ({"loss": [1]}, "field 'loss' is list"),
    ({"step": True}, "field 'step' is bool"),
    ({"step_time_s": None, "step": None}, "field 'step' is NoneType"),
])
def test_report_on_records_of_the_wrong_types_is_one_line(tmp_path, capsys, change, expected):
    record = {**_record(tmp_path), **change}
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(record) + "\n")
    code = main(["report", str(path), "--out", str(tmp_path / "report")])
    _one_line(capsys, code, f"{path}: line 1: {expected}")
    assert not (tmp_path / "report").exists()


def test_report_on_a_record_without_a_field_is_one_line(tmp_path, capsys):
    record = _record(tmp_path)
    del record["step_time_s"]
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(record) + "\n")
    _one_line(capsys, main(["report", str(path), "--out", str(tmp_path / "r")]),
              "field 'step_time_s' is missing")


@pytest.mark.parametrize("content,expected", [
    ("garbage {\n", "not JSON"),
    ('{"rows": 1}', "not a list of rows"),
    ('[{"op": "all_reduce"}]', "row 0 has no positive number 'size_bytes'"),
])
def test_plan_calibrate_on_garbage_is_one_line(tmp_path, capsys, content, expected):
    path = tmp_path / "garbage.jsonl"
    path.write_text(content)
    code = main(["plan", "--devices", "8", "--calibrate", str(path)])
    _one_line(capsys, code, f"--calibrate {path}: {expected}")
