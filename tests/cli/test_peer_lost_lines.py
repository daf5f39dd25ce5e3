"""A checkpoint save that fails because a peer process was killed (gloo: "Connection reset by
peer") is said as the missing rank, not as a failed save of checkpoint.dir."""
import socket

import jax
import pytest

import trainspec.jax.train
from trainspec.core import arrivals
from trainspec.core.errors import LeaveNow
from trainspec.core.spec import default_spec
from trainspec.jax.checkpoint import CheckpointSaveError


def test_a_save_that_lost_a_killed_peer_names_the_rank(tmp_path, monkeypatch):
    from trainspec.jax.backend import JaxBackend

    gone = 2**22 + 12345  # above pid_max's default: no process has it
    arrivals.StepMarks(tmp_path, 0, world=2).entered(6)
    (tmp_path / arrivals.MARKS_DIR / "1").write_text(f"6 {gone} {socket.gethostname()}\n")

    def train(*_, **__):
        raise CheckpointSaveError(f"checkpoint.dir: saving to {tmp_path} failed: "
                                  "Gloo AllGather failed: Connection reset by peer")

    monkeypatch.setattr(trainspec.jax.train, "run", train)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(LeaveNow) as left:
        JaxBackend().train(default_spec(), tmp_path, runtime=None)
    assert str(left.value) == (
        "collectives.timeout_s: step 6's AllGather waited up to 120 s for rank(s) 1, which did "
        f"not arrive (rank 1 last entered step 6, its process {gone} gone; rank 0 had entered "
        "step 6); the same command resumes from the newest good checkpoint")
