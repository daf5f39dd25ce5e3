"""The reference model with a pipeline axis on torch (trainspec/torch/pipeline.py), through the
CLI: `trainspec train --framework torch --nprocs 4` on pipeline 2 x fsdp 2 (the default
schedule, 1f1b, 2 pipeline micro-batches per rank's rows) against the same job without a
pipeline (fsdp 2) and against the JAX pipeline (data 2 x pipeline 2 x tensor 2, gpipe), all
from the JAX run's initial parameters (`--init-from`): the per-step loss and gradient norm
within 1e-5 over 10 float32 steps. Gradients are clipped at 1.0 from the first step, so a
wrong gradient (a micro-batch lost, a stage's part applied twice) changes every update, not
only the reported number; the JAX and torch pipelines run different schedules, and the loss
is summed over micro-batches the same way by both."""
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from cli_runs import trained_trajectory
from tiny import TINY

pytestmark = pytest.mark.slow  # one JAX run and two torch jobs of 10 steps: about 3 minutes

STEPS, RTOL = 10, 1e-5
SETS = [*TINY, "model.n_layers=2", "metrics.interval=1", "checkpoint.interval=0"]
TORCH_PIPELINE = ['mesh.axes={stage={role="pipeline",size=2},data={size=1},fsdp={size=2},'
                  'tensor={size=1}}']
TORCH_FLAT = ["mesh.axes.data.size=1", "mesh.axes.fsdp.size=2"]
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


def test_the_pipelined_run_writes_every_stage_s_initial_parameters(runs):
    """Each stage holds some of the parameters; the run's file gathers all of them."""
    started, given = (load_file(str(runs[name][0] / "initial_params.safetensors"))
                      for name in ("torch_pipeline", "jax_pipeline"))
    assert sorted(started) == sorted(given)
    for name in given:
        np.testing.assert_array_equal(started[name], given[name], err_msg=name)
