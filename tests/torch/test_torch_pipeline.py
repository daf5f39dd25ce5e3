"""The reference model with a pipeline axis on torch (trainspec/torch/pipeline.py), through the
CLI: `trainspec train --framework torch --nprocs 4` on pipeline 2 x fsdp 2 (the default
schedule, 1f1b, 2 pipeline micro-batches per rank's rows) against the same job without a
pipeline (fsdp 2) and against the JAX pipeline (data 2 x pipeline 2 x tensor 2, gpipe), all
from the JAX run's initial parameters (`--init-from`): the per-step loss and gradient norm
within 1e-5 over 10 float32 steps. Gradients are clipped at 1.0 from the first step, so a
wrong gradient (a micro-batch lost, a stage's part applied twice) changes every update, not
only the reported number; the JAX and torch pipelines run different schedules, and the loss
is summed over micro-batches the same way by both.

The torch pipeline run is also the uninterrupted reference of a resume: the same run killed
with kill -9 after its first checkpoint resumes onto 4 stages (pipeline 4, 4 ranks), and
continues the uninterrupted losses within 1e-4 (a checkpoint stores every parameter and its
optimizer state by name, whichever stage held it). Onto no pipeline (fsdp 2, 2 ranks) the
resume measured the same margin once (docs/results.md); the suite runs the stage-count change
alone, for its time."""
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from cli_runs import kill_9_after_first_checkpoint, read_records, read_summary, run_cli_ok
from cli_runs import train_command
from cli_runs import trained_trajectory
from run_dirs import recorded_losses
from tiny import TINY, tiny_spec

pytestmark = pytest.mark.slow  # one JAX run, four torch jobs of 10 steps: about 3.5 minutes

STEPS, RTOL, RESUMED_ATOL = 10, 1e-5, 1e-4
SETS = [*TINY, "model.n_layers=4", "metrics.interval=1", "checkpoint.interval=0"]
CHECKPOINTED = ["checkpoint.interval=4", "checkpoint.keep=2"]
TORCH_PIPELINE = ['mesh.axes={stage={role="pipeline",size=2},data={size=1},fsdp={size=2},'
                  'tensor={size=1}}', *CHECKPOINTED]
TORCH_FLAT = ['mesh.axes={data={size=1},fsdp={size=2},tensor={size=1}}']
RESUMED_ONTO = {  # (overrides, ranks)
    "pipeline4": (['mesh.axes={stage={role="pipeline",size=4},data={size=1},fsdp={size=1},'
                   'tensor={size=1}}', *CHECKPOINTED], 4)}
JAX_PIPELINE = ['mesh.axes={data={size=2},stage={role="pipeline",size=2},fsdp={size=1},'
                'tensor={size=2}}', 'pipeline.schedule="gpipe"']


def _train(run_dir: Path, overrides: list[str], *extra: str) -> dict[str, np.ndarray]:
    return trained_trajectory(run_dir, [*SETS, *overrides], *extra, steps=STEPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    tmp = tmp_path_factory.mktemp("pipeline")
    jax_dir = tmp / "jax_pipeline"
    out = {"jax_pipeline": (jax_dir, _train(jax_dir, JAX_PIPELINE))}
    for name, sets, ranks in (("torch_pipeline", TORCH_PIPELINE, 4),
                              ("torch_flat", TORCH_FLAT, 2)):
        out[name] = (tmp / name, _train(tmp / name, sets, "--framework", "torch", "--nprocs",
                                        str(ranks), "--init-from", str(jax_dir)))
    return out


@pytest.mark.parametrize("reference", ["torch_flat", "jax_pipeline"])
def test_ten_torch_pipeline_steps_equal_the_reference(runs, reference):
    got, want = runs["torch_pipeline"][1], runs[reference][1]
    for quantity in ("loss", "grad_norm"):
        worst = float(np.max(np.abs(got[quantity] - want[quantity]) / np.abs(want[quantity])))
        print(f"torch pipeline vs {reference}, {quantity}: largest relative difference "
              f"{worst:.2e}")
        np.testing.assert_allclose(got[quantity], want[quantity], rtol=RTOL, err_msg=quantity)


def test_the_records_count_the_stage_to_stage_sends_on_the_pipeline_axis(runs):
    """Rank 0 (stage 0) sends each micro-batch's activations to stage 1: its rows (the batch
    over fsdp 2) x seq_len x d_model float32 in all, plus the few bytes of their metadata;
    counted as collective-permutes on the pipeline axis."""
    spec = tiny_spec()
    activations = spec.batch.global_batch // 2 * spec.batch.seq_len * spec.model.d_model * 4
    record = read_records(runs["torch_pipeline"][0])[-1]
    sent = record["comm_bytes_by_kind"]["collective-permute"]
    assert activations <= sent <= 1.05 * activations, (sent, activations)
    assert record["comm_bytes_by_axis"]["stage"] == sent


def test_the_pipelined_run_writes_every_stage_s_initial_parameters(runs):
    """Each stage holds some of the parameters; the run's file gathers all of them."""
    started, given = (load_file(str(runs[name][0] / "initial_params.safetensors"))
                      for name in ("torch_pipeline", "jax_pipeline"))
    assert sorted(started) == sorted(given)
    for name in given:
        np.testing.assert_array_equal(started[name], given[name], err_msg=name)


def _torch_command(run_dir: Path, overrides: list[str], ranks: int, *extra: str) -> list[str]:
    return train_command(run_dir, [*SETS, *overrides], *extra, steps=STEPS, framework="torch",
                         nprocs=ranks)


@pytest.fixture(scope="module")
def killed(runs, tmp_path_factory) -> tuple[Path, int]:
    """The torch pipeline run killed with kill -9 after its first checkpoint: (its run dir,
    the step it last saved)."""
    run_dir = tmp_path_factory.mktemp("pipeline_killed") / "killed"
    cmd = _torch_command(run_dir, TORCH_PIPELINE, 4, "--init-from",
                         str(runs["jax_pipeline"][0]))
    saved = kill_9_after_first_checkpoint(cmd)[-1]
    assert max(recorded_losses(run_dir)) < STEPS
    return run_dir, saved


@pytest.mark.parametrize("onto", sorted(RESUMED_ONTO))
def test_kill_9_then_resume_onto_another_stage_count(runs, killed, tmp_path, onto):
    killed_dir, saved = killed
    run_dir = tmp_path / "resumed"
    shutil.copytree(killed_dir, run_dir)
    overrides, ranks = RESUMED_ONTO[onto]
    run_cli_ok(_torch_command(run_dir, overrides, ranks))
    assert read_summary(run_dir)["resumed_from"] == saved
    resumed = recorded_losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    reference = runs["torch_pipeline"][1]["loss"]
    largest = max(abs(resumed[s] - reference[s - 1]) for s in resumed)
    print(f"onto {onto}: resumed from step {saved}, largest loss difference {largest:.2g}")
    assert largest <= RESUMED_ATOL
