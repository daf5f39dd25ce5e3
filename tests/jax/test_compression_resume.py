"""kill -9 of a compressed run (collectives.compression bf16, int8; 8 replicas, so the
error-feedback residual is state), then a rerun on the same mesh: it resumes from the newest
complete checkpoint and its losses equal an uninterrupted run's bit for bit. A residual that
was not saved, or restored wrong, changes the next step's gradient sum and so the losses after
it. compression = "none" is the default job of tests/jax/test_checkpoint_crash.py."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from run_dirs import recorded_losses
from test_checkpoint_crash import ROOT, _complete_steps, _env
from tiny import TINY

pytestmark = pytest.mark.slow

STEPS, INTERVAL = 12, 4


def _cmd(run_dir, compression):
    sets = [*TINY, "metrics.interval=1", f"checkpoint.interval={INTERVAL}", "checkpoint.keep=2",
            f'collectives.compression="{compression}"', "collectives.compression_block=32"]
    return [sys.executable, "-m", "trainspec.cli.main", "train", "--quiet", "--steps",
            str(STEPS), "--run-dir", str(run_dir), "--summary-json", str(run_dir / "summary.json"),
            *[a for s in sets for a in ("--set", s)]]


def _run(run_dir, compression):
    result = subprocess.run(_cmd(run_dir, compression), capture_output=True, text=True,
                            env=_env(), cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_kill_9_then_resume_is_bitwise(tmp_path, compression):
    _run(tmp_path / "reference", compression)
    reference = recorded_losses(tmp_path / "reference")
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(killed, compression), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    deadline = time.time() + 300
    while not _complete_steps(killed) and time.time() < deadline:  # right after the first save
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the kill: the test tests nothing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(recorded_losses(killed)) < STEPS
    saved = _complete_steps(killed)[-1]
    _run(killed, compression)
    assert json.loads((killed / "summary.json").read_text())["resumed_from"] == saved
    assert recorded_losses(killed) == reference
