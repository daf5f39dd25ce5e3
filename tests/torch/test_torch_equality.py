"""Cross-framework equality through the CLI: `trainspec train` on JAX (1 process x 8 devices)
writes RUN_DIR/initial_params.safetensors; `trainspec train --framework torch --init-from RUN_DIR`
starts from those parameters on every layout the torch capability table accepts, and the
per-step loss and gradient norm agree to rtol 1e-5 over 20 float32 steps. Gradients are
clipped at 1.0 from the first step (the tiny model's norm is above it), so a wrong norm
changes every update, not only the reported number.

The JAX side runs once per layout family (one reference for the layouts without
accumulation, one with micro-batches): JAX's own layouts agree with each other to float32
rounding (tests/jax/test_step.py), far inside the tolerance. Without --init-from the torch run
starts from its own draws and misses the tolerance: the comparison can fail."""
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from cli_runs import trained_trajectory
from tiny import TINY

pytestmark = pytest.mark.slow

STEPS, RTOL = 20, 1e-5
# every step recorded; no held-out evaluation (not compared here; it would cost every run an
# eval program on JAX and eval passes on every torch rank)
SETS = [*TINY, "metrics.interval=1", "checkpoint.interval=0", "eval.interval=0"]
DATA1 = "mesh.axes.data.size=1"
FSDP = "mesh.axes.fsdp.size=-1"
ACCUMULATE = "batch.micro_batch=8"  # 2 micro-batches of the 16 rows
# layout -> (JAX reference family, torch ranks, torch spec overrides). The tiny model's 2 heads
# allow a tensor axis of 2. A one-axis layout runs on 2 ranks: the same reduction and sharding
# code as on 4, at half the processes; the two-axis layouts need 4.
LAYOUTS = {
    "data": ("plain", 2, []),
    "fsdp": ("plain", 2, [DATA1, FSDP]),
    "tensor": ("plain", 2, [DATA1, "mesh.axes.tensor.size=2"]),
    "data_x_tensor": ("plain", 4, ["mesh.axes.tensor.size=2"]),
    "fsdp_x_tensor": ("plain", 4, [DATA1, FSDP, "mesh.axes.tensor.size=2"]),
    "zero1": ("plain", 2, ["layout.optimizer_state=shard_over_data"]),
    "data2_x_fsdp2_micro": ("accumulation", 4,
                            ["mesh.axes.data.size=2", "mesh.axes.fsdp.size=2", ACCUMULATE]),
}
FAMILIES = {"plain": [], "accumulation": [ACCUMULATE]}


def _train(run_dir: Path, overrides: list[str], *extra: str,
           steps: int = STEPS) -> dict[str, np.ndarray]:
    """`trainspec train` into `run_dir`; the per-step loss and gradient norm it recorded."""
    return trained_trajectory(run_dir, [*SETS, *overrides], *extra, steps=steps)


@pytest.fixture(scope="module")
def jax_runs(tmp_path_factory):
    """family -> (run dir, trajectories) of the JAX reference on the default 8-device layout."""
    tmp = tmp_path_factory.mktemp("jax")
    return {name: (tmp / name, _train(tmp / name, sets)) for name, sets in FAMILIES.items()}


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory, jax_runs):
    """layout -> (run dir, trajectories) of torch started from the JAX run's parameters."""
    tmp = tmp_path_factory.mktemp("torch")
    runs = {}
    for name, (family, ranks, sets) in LAYOUTS.items():
        runs[name] = (tmp / name, _train(tmp / name, sets, "--framework", "torch", "--nprocs",
                                         str(ranks), "--init-from", str(jax_runs[family][0])))
    return runs


def _largest_relative_difference(got, want) -> tuple[float, int]:
    """(the largest |got - want| / |want|, the step it is at)."""
    relative = np.abs(got - want) / np.abs(want)
    return float(relative.max()), int(relative.argmax()) + 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torch_follows_jax_from_the_same_start(jax_runs, torch_runs, layout):
    run_dir, torch = torch_runs[layout]
    reference_dir, jax = jax_runs[LAYOUTS[layout][0]]
    for quantity in ("loss", "grad_norm"):
        worst, step = _largest_relative_difference(torch[quantity], jax[quantity])
        print(f"{layout} {quantity}: largest relative difference {worst:.2e} (step {step})")
        np.testing.assert_allclose(torch[quantity], jax[quantity], rtol=RTOL, err_msg=quantity)
    # the torch run's own file (gathered from its shards) holds the numbers it started from
    started, given = (load_file(str(d / "initial_params.safetensors"))
                      for d in (run_dir, reference_dir))
    assert sorted(started) == sorted(given)
    for name in given:
        np.testing.assert_array_equal(started[name], given[name], err_msg=name)


def test_without_init_from_torch_misses_the_tolerance(tmp_path, jax_runs):
    """Its own draws (the same distributions, other numbers): the comparison above can fail,
    from the first steps on."""
    torch = _train(tmp_path / "own_start", [], "--framework", "torch", "--nprocs", "2", steps=2)
    worst, _ = _largest_relative_difference(torch["loss"], jax_runs["plain"][1]["loss"][:2])
    print(f"torch from its own draws: largest relative loss difference {worst:.2e}")
    assert worst > 100 * RTOL
