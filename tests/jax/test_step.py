"""wrap(): the same step on every layout, and token-weighted micro-batch accumulation."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

from trainspec.jax import loss_step, wrap
from trainspec.core.data import ByteBatches
from trainspec.core.errors import UserInputError
from trainspec.jax.models.transformer import Transformer, next_token_loss
from trainspec.core.spec import ModelSpec, load_spec

pytestmark = pytest.mark.slow

MODEL = ModelSpec(vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64)
SEQ, BATCH = 16, 16


def _spec(axes, micro=BATCH, **extra):
    return load_spec({
        "mesh": {"axes": axes},
        "batch": {"global_batch": BATCH, "micro_batch": micro, "seq_len": SEQ},
        **extra,
    })


def _loss_fn(params, batch):
    logits = Transformer(MODEL).apply({"params": params}, batch["inputs"])
    loss_sum, tokens = next_token_loss(logits, batch["targets"], batch["mask"])
    return loss_sum, tokens, {}


# sgd(1): one step's parameter change is minus the gradient, so updates compare gradients.
# Made once: the optimizer is static state structure, and init_fn must build the same one each call.
SGD = optax.sgd(1.0)


def _init_state(rng):
    params = Transformer(MODEL).init(rng, jnp.zeros((1, SEQ), jnp.int32))["params"]
    return TrainState.create(apply_fn=None, params=params, tx=SGD)


def _batch(ragged=False):
    batch = ByteBatches(SEQ, BATCH, seed=3).batch(0)
    if ragged:  # each sequence keeps a different number of valid tokens: 1 .. SEQ
        lengths = np.random.default_rng(0).integers(1, SEQ + 1, BATCH)
        batch["mask"] = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.float32)
    return batch


def _one_step(spec, batch, devices=None):
    mesh = None
    if devices is not None:
        from trainspec.jax.mesh import build_mesh
        mesh = build_mesh(spec, devices)
    step = wrap(loss_step(_loss_fn), spec, mesh)
    state = step.init(_init_state, jax.random.key(0))
    params0 = jax.tree.map(np.asarray, state.params)
    new_state, metrics = step(state, batch)
    grads = jax.tree.map(lambda a, b: a - np.asarray(b), params0, new_state.params)
    return float(metrics["loss"]), grads


LAYOUTS = {
    "data": {"data": {"size": 8}},
    "fsdp": {"fsdp": {"size": 8}},
    "tensor": {"data": {"size": 2}, "tensor": {"size": 4}},
    "data_fsdp_tensor": {"data": {"size": 2}, "fsdp": {"size": 2}, "tensor": {"size": 2}},
}


@pytest.fixture(scope="module")
def single_device_reference():
    return _one_step(_spec({"data": {"size": 1}}), _batch(), devices=jax.devices()[:1])


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_agree_with_one_device(name, single_device_reference):
    """Loss and gradients match the 1-device run.

    Tolerance: float32 with the reductions (batch sums, matmul contractions split over fsdp or
    tensor shards) re-associated. Each summed quantity has at most ~4k terms; the observed
    relative error is ~1e-6, the bound used is rtol 1e-5 on the loss and 1e-4 of the largest
    gradient entry per array, an order of magnitude above what re-association produces and
    orders below a real bug (a missing shard changes gradients by O(1/8)).
    """
    ref_loss, ref_grads = single_device_reference
    loss, grads = _one_step(_spec(LAYOUTS[name]), _batch())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for path, g, r in zip(jax.tree_util.tree_leaves_with_path(ref_grads),
                          jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        scale = np.max(np.abs(r))
        np.testing.assert_allclose(g, r, atol=1e-4 * scale, rtol=0, err_msg=str(path[0]))


def _mean_of_micro_means_update(k):
    """What the wrong rule (average of per-micro-batch mean losses) would give, on one device."""
    batch = _batch(ragged=True)
    params = jax.jit(_init_state)(jax.random.key(0)).params

    def micro_mean(p, j):
        micro = jax.tree.map(lambda x: x[j::k], batch)  # the same interleaved split as wrap()
        loss_sum, tokens, _ = _loss_fn(p, micro)
        return loss_sum / tokens

    return jax.jit(jax.grad(lambda p: sum(micro_mean(p, j) for j in range(k)) / k))(params)


def test_accumulation_with_ragged_masks_matches_full_batch():
    """4 micro-batches, ragged masks, on data x fsdp = 2 x 2: the update equals the full batch's.

    Both runs are float32 on the same mesh; they differ only in summation order (per micro-batch
    partial sums), so the agreement is to ~1e-6 relative: rtol 1e-5 of each array's scale.
    """
    axes = {"data": {"size": 2}, "fsdp": {"size": 2}}
    devices = jax.devices()[:4]
    full_loss, full = _one_step(_spec(axes), _batch(ragged=True), devices)
    acc_loss, acc = _one_step(_spec(axes, micro=BATCH // 4), _batch(ragged=True), devices)
    np.testing.assert_allclose(acc_loss, full_loss, rtol=1e-5)
    wrong = _mean_of_micro_means_update(4)
    worst_wrong = 0.0
    for a, f, w in zip(jax.tree.leaves(acc), jax.tree.leaves(full), jax.tree.leaves(wrong)):
        scale = np.max(np.abs(f))
        np.testing.assert_allclose(a, f, atol=1e-5 * scale, rtol=0)
        worst_wrong = max(worst_wrong, np.max(np.abs(np.asarray(w) - f)) / scale)
    # The test discriminates: the mean-of-means rule misses by far more than the tolerance.
    assert worst_wrong > 1e-2


def test_opaque_step_cannot_accumulate():
    def step(state, batch):
        return state, {}

    with pytest.raises(UserInputError, match="batch.micro_batch"):
        wrap(step, _spec({"data": {"size": 8}}, micro=BATCH // 2))


def test_opaque_step_is_placed_and_donated():
    """A plain (state, batch) -> (state, metrics) step: state keeps its sharding, input donated."""
    tx = optax.adam(1e-2)

    def step(state, batch):
        def loss(p):
            s, t, _ = _loss_fn(p, batch)
            return s / t
        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    def init(rng):
        params = Transformer(MODEL).init(rng, jnp.zeros((1, SEQ), jnp.int32))["params"]
        return TrainState.create(apply_fn=None, params=params, tx=tx)

    wrapped = wrap(step, _spec({"fsdp": {"size": 8}}))
    state = wrapped.init(init, jax.random.key(0))
    kernel = state.params["block_0"]["mlp_in"]["kernel"]
    assert kernel.sharding.spec[0] == "fsdp"  # embed dim split 8 ways: never whole on a device
    assert kernel.addressable_shards[0].data.shape == (MODEL.d_model // 8, MODEL.d_ff)
    new_state, metrics = wrapped(state, _batch())
    assert kernel.is_deleted()  # donated
    assert new_state.params["block_0"]["mlp_in"]["kernel"].sharding == kernel.sharding
    assert np.isfinite(float(metrics["loss"]))


def test_bf16_compute_keeps_float32_params():
    spec = _spec({"data": {"size": 8}}, precision={"compute": "bfloat16"})
    loss, grads = _one_step(spec, _batch())
    assert np.isfinite(loss)
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))


def test_micro_batch_must_split_over_batch_shards():
    with pytest.raises(UserInputError, match=r"batch\.micro_batch: 4 .* 8 batch shards"):
        wrap(loss_step(_loss_fn), _spec({"data": {"size": 8}}, micro=4))
