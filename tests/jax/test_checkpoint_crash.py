"""kill -9 of `trainspec train` at random points: the rerun resumes from the newest complete
checkpoint, loses nothing before it, and its losses equal an uninterrupted run's bit for bit."""
import os
import random
import signal
import subprocess
import time

import pytest

from run_dirs import recorded_losses, signal_when
from tiny import TINY
from cli_runs import cli_env, complete_checkpoints, read_summary, run_cli_ok, start_cli
from cli_runs import train_command

pytestmark = pytest.mark.slow

STEPS, INTERVAL = 24, 4
JOB = [*TINY, "metrics.interval=1", f"checkpoint.interval={INTERVAL}", "checkpoint.keep=2"]


def _cmd(run_dir):
    return train_command(run_dir, JOB, steps=STEPS)


def _recorded_steps(run_dir):
    """Steps whose record is complete (a line with its newline) in metrics.jsonl, 0 before any."""
    path = run_dir / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    run_cli_ok(_cmd(run_dir), env=cli_env())
    return recorded_losses(run_dir)


@pytest.mark.parametrize("trial", [0, 1])
def test_kill_9_then_resume_matches_uninterrupted(tmp_path, reference, trial):
    rng = random.Random(trial)
    proc = start_cli(_cmd(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                 env=cli_env())
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
    complete = complete_checkpoints(tmp_path)
    assert complete, "the kill came before any checkpoint: the trial tests nothing"
    killed_at = max(recorded_losses(tmp_path))

    run_cli_ok(_cmd(tmp_path), env=cli_env())
    summary = read_summary(tmp_path)
    # resumed from the newest complete checkpoint: at most the work since it is lost
    assert summary["resumed_from"] == complete[-1]
    assert killed_at - summary["resumed_from"] <= 2 * INTERVAL  # one interval + one in flight
    assert recorded_losses(tmp_path) == reference
    print(f"trial {trial}: killed after step {killed_at}, resumed from {complete[-1]}")


def test_sigterm_checkpoints_the_current_step_and_resumes_bitwise(tmp_path, reference):
    """SIGTERM mid-run: the step in progress finishes, is checkpointed (between the regular
    checkpoints), and the process exits 143 saying where; the rerun loses no step."""
    proc = start_cli(_cmd(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                 env=cli_env())
    metrics = tmp_path / "metrics.jsonl"
    _, err = signal_when(proc, lambda: metrics.exists()
                         and len(metrics.read_text().splitlines()) >= INTERVAL + 2)
    assert proc.returncode == 143, err
    stopped_at = max(recorded_losses(tmp_path))
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"trainspec: stopped: SIGTERM after step {stopped_at}; checkpoint "
                           f"{stopped_at} is in "), line
    assert stopped_at in complete_checkpoints(tmp_path)

    run_cli_ok(_cmd(tmp_path), env=cli_env())
    assert read_summary(tmp_path)["resumed_from"] == stopped_at
    assert recorded_losses(tmp_path) == reference
