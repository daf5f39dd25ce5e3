"""`trainspec train` and `trainspec validate`: the default job learns; bad input is one line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runs import read_records
from trainspec.cli.main import main
from xla_env import without_device_count

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, cwd, **env):
    """Run the real entry point in a fresh process (device setup, exit code, stderr), in `cwd`:
    a test's own directory, where a command without --run-dir writes runs/default."""
    return subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", *args],
        capture_output=True, text=True, timeout=600, cwd=cwd,
        env={**without_device_count(), **env},
    )


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    # Compiled at XLA's default, as a user runs it: 30 steps of the default model repay the
    # optimisation (alone, 2 cores: 29 s of CPU against 37 s with the suite's switch on).
    result = _cli("train", "--steps", "30", "--run-dir", str(run_dir), "--quiet",
                  "--summary-json", str(run_dir / "summary.json"), cwd=run_dir,
                  JAX_DISABLE_MOST_OPTIMIZATIONS="0")
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_default_job_learns(default_run):
    run_dir, result = default_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"initial_loss", "final_loss", "tokens_per_s", "step_time_s", "steps", "mesh"} <= set(summary)
    assert summary["steps"] == 30
    assert summary["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}  # 8 CPU devices by default
    assert summary["final_loss"] < summary["initial_loss"] - 1.0  # bytes: ln 256 = 5.5 to < 4.5
    assert summary["tokens_per_s"] > 0
    assert "loss" in result.stdout and "tokens/s" in result.stdout


def test_metrics_jsonl_has_a_record_per_interval(default_run):
    run_dir, _ = default_run
    records = read_records(run_dir)
    steps = [r["step"] for r in records]
    assert steps == [1, 5, 10, 15, 20, 25, 30]  # default spec: metrics.interval = 5
    assert all("step_time_s" in r and "tokens_per_s" in r for r in records[1:])


def test_host_devices_option_changes_mesh(tmp_path):
    result = _cli("validate", str(ROOT / "examples/fsdp.toml"), "--host-devices", "4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "mesh: data=1 x fsdp=4" in result.stdout


def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path):
    result = _cli("train", "--set", "batch.micro_batch=7", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "micro_batch" in result.stderr


def test_validate_prints_mesh_and_layout(capsys):
    assert main(["validate", str(ROOT / "examples/mixed.toml")]) == 0
    out = capsys.readouterr().out
    assert "mesh: data=2 x fsdp=2 x tensor=2" in out
    assert "P('fsdp', 'tensor')" in out  # mlp_in kernel: embed over fsdp, mlp over tensor
    assert "accumulation steps" in out


BAD_ARGS = {
    "missing spec file": (["train", "--spec", "nope.toml"], "spec file not found: nope.toml"),
    "unknown field": (["train", "--set", "batch.sizes=3"], "field 'batch.sizes': unknown field"),
    "wrong type": (["train", "--set", "seed=\"x\""], "field 'seed'"),
    "impossible mesh": (["train", "--set", "mesh.axes.fsdp.size=3"], "8 devices are not divisible"),
    "too many devices": (
        ["train", "--set", "mesh.axes.data.size=4", "--set", "mesh.axes.fsdp.size=4"],
        "needs 16 devices, but 8 are available",
    ),
    "batch not divisible by data axes": (
        ["train", "--set", "batch.global_batch=12", "--set", "batch.micro_batch=12"],
        "batch.micro_batch: 12 sequences per micro-batch are not divisible by the 8 batch shards",
    ),
    "bad steps": (["train", "--steps", "-3"], "argument --steps"),
    "unknown excluded device": (["validate", str(ROOT / "examples/data.toml"), "--set",
                                 "mesh.exclude_devices=[42]"], "mesh.exclude_devices"),
    "missing validate file": (["validate", "absent.toml"], "spec file not found"),
    "bad --set": (["train", "--set", "novalue"], "--set expects key.path=value"),
}


@pytest.mark.parametrize("case", BAD_ARGS)
def test_bad_input_cases(case, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --run-dir, runs/default, is relative
    argv, expected = BAD_ARGS[case]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert err.count("\n") == 1 and "Traceback" not in err

