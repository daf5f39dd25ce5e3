"""kill -9 of `trainspec train` at random points: the rerun resumes from the newest complete
checkpoint, loses nothing before it, and its losses equal an uninterrupted run's bit for bit."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run_dirs import recorded_losses, signal_when
from tiny import TINY
from xla_env import without_device_count

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS, INTERVAL = 24, 4
JOB = [*TINY, "metrics.interval=1", f"checkpoint.interval={INTERVAL}", "checkpoint.keep=2"]


def _cmd(run_dir):
    sets = [a for s in JOB for a in ("--set", s)]
    return [sys.executable, "-m", "trainspec.cli.main", "train", "--quiet", "--steps", str(STEPS),
            "--run-dir", str(run_dir), "--summary-json", str(run_dir / "summary.json"), *sets]


def _env():
    return {**without_device_count(), "TRAINSPEC_FAULTS": "{}"}


def _recorded_steps(run_dir):
    """Steps whose record is complete (a line with its newline) in metrics.jsonl, 0 before any."""
    path = run_dir / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _complete_steps(run_dir):
    root = run_dir / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    result = subprocess.run(_cmd(run_dir), capture_output=True, text=True, env=_env(), cwd=ROOT,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    return recorded_losses(run_dir)


@pytest.mark.parametrize("trial", [0, 1])
def test_kill_9_then_resume_matches_uninterrupted(tmp_path, reference, trial):
    rng = random.Random(trial)
    proc = subprocess.Popen(_cmd(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_env(), cwd=ROOT)
    # A random point after the first save and well before the end: a sleep of random length
    # after the first save let an unloaded machine finish all 24 steps before the kill came.
    kill_after = rng.randint(INTERVAL + 1, STEPS - INTERVAL)
    deadline = time.time() + 300
    while _recorded_steps(tmp_path) < kill_after and time.time() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.02))  # then mid-step, mid-save, ...
    assert proc.poll() is None, "the run ended before the kill: the trial tests nothing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    complete = _complete_steps(tmp_path)
    assert complete, "the kill came before any checkpoint: the trial tests nothing"
    killed_at = max(recorded_losses(tmp_path))

    result = subprocess.run(_cmd(tmp_path), capture_output=True, text=True, env=_env(), cwd=ROOT,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    # resumed from the newest complete checkpoint: at most the work since it is lost
    assert summary["resumed_from"] == complete[-1]
    assert killed_at - summary["resumed_from"] <= 2 * INTERVAL  # one interval + one in flight
    assert recorded_losses(tmp_path) == reference
    print(f"trial {trial}: killed after step {killed_at}, resumed from {complete[-1]}")


def test_sigterm_checkpoints_the_current_step_and_resumes_bitwise(tmp_path, reference):
    """SIGTERM mid-run: the step in progress finishes, is checkpointed (between the regular
    checkpoints), and the process exits 143 saying where; the rerun loses no step."""
    proc = subprocess.Popen(_cmd(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=ROOT)
    metrics = tmp_path / "metrics.jsonl"
    _, err = signal_when(proc, lambda: metrics.exists()
                         and len(metrics.read_text().splitlines()) >= INTERVAL + 2)
    assert proc.returncode == 143, err
    stopped_at = max(recorded_losses(tmp_path))
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"trainspec: stopped: SIGTERM after step {stopped_at}; checkpoint "
                           f"{stopped_at} is in "), line
    assert stopped_at in _complete_steps(tmp_path)

    result = subprocess.run(_cmd(tmp_path), capture_output=True, text=True, env=_env(), cwd=ROOT,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["resumed_from"] == stopped_at
    assert recorded_losses(tmp_path) == reference
