"""kill -9 of a compressed run (collectives.compression bf16, int8; 8 replicas, so the
error-feedback residual is state), then a rerun on the same mesh: it resumes from the newest
complete checkpoint and its losses equal an uninterrupted run's bit for bit. A residual that
was not saved, or restored wrong, changes the next step's gradient sum and so the losses after
it. compression = "none" is the default job of tests/jax/test_checkpoint_crash.py."""

import pytest

from run_dirs import recorded_losses
from tiny import TINY
from cli_runs import cli_env, kill_9_after_first_checkpoint, run_cli_ok, read_summary
from cli_runs import train_command

pytestmark = pytest.mark.slow

STEPS, INTERVAL = 12, 4


def _cmd(run_dir, compression):
    sets = [*TINY, "metrics.interval=1", f"checkpoint.interval={INTERVAL}", "checkpoint.keep=2",
            f'collectives.compression="{compression}"', "collectives.compression_block=32"]
    return train_command(run_dir, sets, steps=STEPS)


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_kill_9_then_resume_is_bitwise(tmp_path, compression):
    run_cli_ok(_cmd(tmp_path / "reference", compression), env=cli_env())
    reference = recorded_losses(tmp_path / "reference")
    killed = tmp_path / "killed"
    saved = kill_9_after_first_checkpoint(_cmd(killed, compression), env=cli_env())[-1]
    assert max(recorded_losses(killed)) < STEPS
    run_cli_ok(_cmd(killed, compression), env=cli_env())
    assert read_summary(killed)["resumed_from"] == saved
    assert recorded_losses(killed) == reference
