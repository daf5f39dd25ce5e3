"""`trainspec train` with collectives.backend = "ext" follows the xla backend's loss curve."""
import json

import jax
import numpy as np
import pytest

from trainspec.core.errors import UserInputError
from trainspec.core.spec import load_spec
from trainspec.jax.step import MAX_STEPS_IN_FLIGHT
from trainspec.jax.train import build_job, run

SMALL = [
    "model.d_model=32", "model.d_ff=64", "model.n_layers=1", "batch.seq_len=32",
    "batch.global_batch=16", "batch.micro_batch=8", "metrics.interval=1",
]


def _losses(tmp_path, backend, axes):
    spec = load_spec(None, SMALL + [f"collectives.backend={backend}"] + axes)
    run(spec, tmp_path / backend, steps=8, progress=False)
    lines = (tmp_path / backend / "metrics.jsonl").read_text().splitlines()
    return np.array([json.loads(line)["loss"] for line in lines])


def test_ext_backend_loss_curve_matches_xla(tmp_path):
    """ext sums the replicas' gradients through the xla_ext all-reduce (rank order), xla lets
    the compiler reduce; both in float32, so they differ by re-association only (~1e-7
    relative per step). Over 8 Adam steps that stays below 1e-5; rtol 1e-4 leaves margin while
    a wrong reduction (a missing or doubled replica) moves the loss by > 1e-2 within 2 steps."""
    axes = ["mesh.axes.data.size=8"]
    xla = _losses(tmp_path, "xla", axes)
    ext = _losses(tmp_path, "ext", axes)
    assert len(xla) == len(ext) == 8
    assert xla[-1] < xla[0]  # it trains
    np.testing.assert_allclose(ext, xla, rtol=1e-4)


def test_ext_backend_refuses_axes_split_inside_a_replica():
    """ext beside XLA's own fsdp/tensor collectives deadlocked the CPU runtime (abort after
    40 s): refused in one line naming the field and the split axes, never a hang."""
    spec = load_spec(None, SMALL + ["collectives.backend=ext", "mesh.axes.data.size=2",
                                    "mesh.axes.fsdp.size=2", "mesh.axes.tensor.size=2"])
    with pytest.raises(UserInputError, match=r"collectives.backend: ext .* fsdp=2, tensor=2"):
        build_job(spec)


@pytest.mark.parametrize("backend", ["xla", "ext"])
def test_wrapped_step_bounds_steps_in_flight_on_more_than_one_device(monkeypatch, backend):
    """The CPU runtime deadlocks with ~100 collective executions in flight, ext's or XLA's own
    (XLA's own with 40 on a loaded machine): the wrapped step itself
    (not only the CLI loop) waits for the oldest step beyond the bound."""
    spec = load_spec(None, SMALL + [f"collectives.backend={backend}", "mesh.axes.data.size=8"])
    job = build_job(spec)
    waited = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or real(x))
    state = job.state
    for i in range(MAX_STEPS_IN_FLIGHT + 3):
        state, _ = job.step(state, job.data.batch(i))
    assert len(waited) == 3


def test_every_backend_the_schema_allows_is_declared_and_unknown_ones_are_one_line():
    """The step, mesh check and capability table read a backend's declarations: a name the
    schema accepts without a declaration would fail deep inside the step instead."""
    from typing import get_args

    from trainspec.core.spec import CollectivesSpec
    from trainspec.jax.backends import BACKENDS, backend

    assert set(get_args(CollectivesSpec.model_fields["backend"].annotation)) == set(BACKENDS)
    for declared in BACKENDS.values():
        assert declared.ops().__name__ == declared.module  # its module imports
    with pytest.raises(UserInputError, match="^unknown collectives backend 'nccl'; known: xla, ext"):
        backend("nccl")
