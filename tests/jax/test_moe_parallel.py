"""The MoE reference model on 8 simulated devices: with expert 2 and 4 and dropless routing,
per-step losses over 10 steps equal the one-device run's within 1e-5; with capacity-limited
routing the dropped assignments are counted, the same on both; the dispatch and combine are
all-to-alls over the expert axis."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainspec.core.moe import moe_layer
from trainspec.core.reference_model import _gelu
from trainspec.core.spec import ModelSpec
from trainspec.jax.mesh import build_mesh
from trainspec.jax.models.moe import MoEMlp
from trainspec.jax.train import build_job
from tiny import tiny_spec

pytestmark = pytest.mark.slow

STEPS = 10
MOE = ("model.moe.experts=4", "model.moe.top_k=2", "model.n_layers=2", "batch.seq_len=16",
       "batch.global_batch=8", "batch.micro_batch=8", "metrics.gns=false")


def _batch(job, index):
    batch = job.data.batch(index)
    rows, seq = batch["mask"].shape
    lengths = np.random.default_rng(index).integers(1, seq + 1, rows)
    batch["mask"] = (np.arange(seq)[None] < lengths[:, None]).astype(np.float32)
    return batch


def _run(axes: dict, devices: int, *overrides: str, steps: int = STEPS):
    spec = tiny_spec(*MOE, *overrides, *(f"mesh.axes.{a}.size={s}" for a, s in axes.items()))
    job = build_job(spec, build_mesh(spec, jax.devices()[:devices]), total_steps=steps)
    state, losses, dropped = job.state, [], []
    for i in range(steps):
        state, metrics = job.step(state, _batch(job, i))
        losses.append(float(metrics["loss"]))
        dropped.append(float(metrics["aux"]["moe_dropped"]))
    return losses, dropped, job


ONE = {"data": 1, "fsdp": 1, "tensor": 1}


@pytest.fixture(scope="module")
def unsharded():
    return _run(ONE, 1)


@pytest.mark.parametrize("experts_axis, data", [(2, 4), (4, 2)])
def test_dropless_losses_equal_the_one_device_run(experts_axis, data, unsharded):
    losses, dropped, job = _run({**ONE, "data": data, "expert": experts_axis}, 8)
    assert dropped == [0.0] * STEPS == unsharded[1]
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, unsharded[0], rtol=0, atol=1e-5)
    hlo = job.step.lower(job.state, job.step.shard_batch(_batch(job, 0))).compile().as_text()
    assert "all-to-all" in hlo


def test_capacity_limited_routing_counts_the_same_drops():
    limited = ("model.moe.capacity_factor=0.5",)
    one = _run(ONE, 1, *limited, steps=3)
    sharded = _run({**ONE, "data": 2, "expert": 4}, 8, *limited, steps=3)
    assert all(d > 0 for d in one[1]) and sharded[1] == one[1]
    np.testing.assert_allclose(sharded[0], one[0], rtol=0, atol=1e-5)



def test_the_layer_equals_the_float64_reference_routing_and_combine():
    """MoEMlp on one device against trainspec.core.moe.moe_layer (float64) with the same
    kernels: routing, drops (capacity 1.0 here) and combine agree to float32 rounding."""
    model = ModelSpec(d_model=8, d_ff=16, n_heads=2,
                      moe={"experts": 4, "top_k": 2, "capacity_factor": 1.0})
    x = np.random.default_rng(0).normal(size=(3, 8, 8)).astype(np.float32)
    layer = MoEMlp(model)
    params = nn.meta.unbox(layer.init(jax.random.key(1), jnp.asarray(x))["params"])
    y, sown = layer.apply({"params": params}, jnp.asarray(x), mutable=["moe"])
    w = {name: np.asarray(a, np.float64) for name, a in params.items()}
    expected, routing = moe_layer(
        x.reshape(-1, 8).astype(np.float64), w["router"],
        lambda e, rows: _gelu(rows @ w["mlp_in"][e])[0] @ w["mlp_out"][e],
        top_k=2, capacity_factor=1.0)
    assert routing.dropped == int(sown["moe"]["dropped"][0]) > 0
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 8), expected, rtol=1e-5, atol=1e-5)


def test_tokens_combined_in_the_wrong_order_fail_the_comparison(monkeypatch, unsharded):
    """Each device's expert outputs given back to its rows in reverse order: the first step's
    loss already differs from the one-device run's."""
    import trainspec.jax.models.moe as moe

    right = moe._expert_parallel
    monkeypatch.setattr(moe, "_expert_parallel", lambda *a, **k: right(*a, **k)[::-1])
    wrong, _, _ = _run({**ONE, "data": 4, "expert": 2}, 8, steps=1)
    assert abs(wrong[0] - unsharded[0][0]) > 1e-3
