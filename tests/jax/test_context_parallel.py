"""The reference job with a context axis on 8 simulated devices: per-step losses over 10 steps
equal to the unsharded run's (one device) within 1e-5, causal, with ragged padding masks, for
context 2 and 4, ring and all_gather attention, zig-zag and contiguous splits."""
import jax
import numpy as np
import pytest

import trainspec.jax.context
from trainspec.jax.mesh import build_mesh
from trainspec.jax.train import build_job
from tiny import tiny_spec

pytestmark = pytest.mark.slow

STEPS = 10


def _batch(job, index):
    batch = job.data.batch(index)
    rows, seq = batch["mask"].shape
    lengths = np.random.default_rng(index).integers(1, seq + 1, rows)  # ragged: 1 .. seq tokens
    batch["mask"] = (np.arange(seq)[None] < lengths[:, None]).astype(np.float32)
    return batch


def _losses(axes: dict, devices: int, *overrides: str, steps: int = STEPS) -> list[float]:
    spec = tiny_spec("model.n_layers=2", "batch.seq_len=32", "batch.global_batch=8",
                     "batch.micro_batch=8", *overrides,
                     *(f"mesh.axes.{a}.size={s}" for a, s in axes.items()))
    job = build_job(spec, build_mesh(spec, jax.devices()[:devices]), total_steps=STEPS)
    state, out = job.state, []
    for i in range(steps):
        state, metrics = job.step(state, _batch(job, i))
        out.append(float(metrics["loss"]))
    return out


@pytest.fixture(scope="module")
def unsharded():
    return _losses({"data": 1, "fsdp": 1, "tensor": 1}, 1)


CASES = {
    "ring zigzag context 2": ({"data": 4, "context": 2}, ()),
    "ring zigzag context 4": ({"data": 2, "context": 4}, ()),
    "all_gather contiguous context 4 with tensor 2": (
        {"data": 1, "tensor": 2, "context": 4},
        ("context.attention=all_gather", "context.split=contiguous")),
}


@pytest.mark.parametrize("case", CASES)
def test_losses_equal_the_unsharded_run(case, unsharded):
    sizes, overrides = CASES[case]
    axes = {"data": 1, "fsdp": 1, "tensor": 1, **sizes}
    losses = _losses(axes, 8, *overrides)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    np.testing.assert_allclose(losses, unsharded, rtol=0, atol=1e-5)


def test_a_causal_mask_off_by_one_block_fails_the_comparison(monkeypatch, unsharded):
    """Every query treated as one chunk (8 tokens) later than it is, so it sees one block of
    keys too many: the first step's loss already differs from the unsharded run's."""
    merge = trainspec.jax.context._merge

    def one_block_late(state, q, k, v, q_pos, k_pos, scale):
        return merge(state, q, k, v, q_pos + 32 // 4, k_pos, scale)

    monkeypatch.setattr(trainspec.jax.context, "_merge", one_block_late)
    wrong = _losses({"data": 4, "fsdp": 1, "tensor": 1, "context": 2}, 8, steps=1)
    assert abs(wrong[0] - unsharded[0]) > 1e-3
