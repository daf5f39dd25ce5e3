"""kill -9 of a pipelined run (pipeline 2 × data 4), then a resume of its run dir onto another
stage count (pipeline 4 × data 2) and onto none (data 8): the checkpoint holds the blocks'
parameters one leaf per block whatever the stage count (trainspec.jax.pipeline), so the
resumed run continues the uninterrupted one's losses, within 1e-4 (float32 sums in another
order on another layout, over a few AdamW steps)."""
import shutil

import pytest

from cli_runs import cli_env, kill_9_after_first_checkpoint, read_summary, run_cli_ok
from cli_runs import train_command
from run_dirs import recorded_losses
from tiny import TINY

pytestmark = pytest.mark.slow

STEPS, INTERVAL = 10, 4
MESHES = {"pipeline2": 'mesh.axes={data={size=4},stage={role="pipeline",size=2}}',
          "pipeline4": 'mesh.axes={data={size=2},stage={role="pipeline",size=4}}',
          "none": "mesh.axes={data={size=8}}"}


def _cmd(run_dir, mesh):
    return train_command(run_dir, [*TINY, "model.n_layers=4", "metrics.interval=1",
                                   f"checkpoint.interval={INTERVAL}", "checkpoint.keep=2",
                                   MESHES[mesh]], steps=STEPS)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """(the uninterrupted run's losses, the killed run dir, the step it last saved)."""
    root = tmp_path_factory.mktemp("pipeline_resume")
    run_cli_ok(_cmd(root / "reference", "pipeline2"), env=cli_env())
    saved = kill_9_after_first_checkpoint(_cmd(root / "killed", "pipeline2"), env=cli_env())[-1]
    assert max(recorded_losses(root / "killed")) < STEPS
    return recorded_losses(root / "reference"), root / "killed", saved


@pytest.mark.parametrize("onto", ["pipeline4", "none"])
def test_kill_9_then_resume_onto_another_stage_count(killed, tmp_path, onto):
    reference, killed_dir, saved = killed
    run_dir = tmp_path / "resumed"
    shutil.copytree(killed_dir, run_dir)
    run_cli_ok(_cmd(run_dir, onto), env=cli_env())
    assert read_summary(run_dir)["resumed_from"] == saved
    resumed = recorded_losses(run_dir)
    assert sorted(resumed) == sorted(reference) == list(range(1, STEPS + 1))
    largest = max(abs(resumed[s] - reference[s]) for s in reference)
    print(f"onto {onto}: resumed from step {saved}, largest loss difference {largest:.2g}")
    assert largest <= 1e-4
