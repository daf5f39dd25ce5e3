"""The JAX step against the spec's NumPy references (trainspec.core), and its documented options.

A linear model with a squared loss: its per-micro-batch gradients are exact in float64 NumPy,
so the step's update can be compared with `core.accumulation.token_weighted` directly.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

from trainspec.jax import build_mesh, loss_step, wrap
from trainspec.core.accumulation import interleaved_micro_batches, mean_of_means, token_weighted
from trainspec.core.errors import UserInputError
from trainspec.core.spec import load_spec

BATCH, SEQ, DIM, K = 8, 5, 3, 4
SGD = optax.sgd(1.0)  # one object: init_fn must rebuild the same pytree metadata every call


def _loss_fn(params, batch):
    err = (batch["x"] @ params["w"] - batch["y"]) * batch["mask"]
    return 0.5 * jnp.sum(err * err), jnp.sum(batch["mask"]), {}


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    mask = (rng.random((BATCH, SEQ)) < 0.6).astype(np.float32)
    mask[0] = 1.0  # ragged: rows from 1 to SEQ valid tokens
    mask[:, 0] = 1.0
    return {"x": rng.standard_normal((BATCH, SEQ, DIM)).astype(np.float32),
            "y": rng.standard_normal((BATCH, SEQ)).astype(np.float32), "mask": mask}


def _reference_parts(w, batch):
    """Per micro-batch (interleaved, as the spec says): loss sum, valid tokens, gradient sum."""
    parts = []
    micro = {k: interleaved_micro_batches(v.astype(np.float64), K) for k, v in batch.items()}
    for j in range(K):
        x, y, m = micro["x"][j], micro["y"][j], micro["mask"][j]
        err = (x @ w - y) * m
        parts.append((0.5 * np.sum(err * err), np.sum(m), np.einsum("bt,btd->d", err, x)))
    return parts


def _wrapped(nan_guard=True, micro=BATCH // K, loss_fn=_loss_fn):
    spec = load_spec({"mesh": {"axes": {"data": {"size": 2}}},
                      "batch": {"global_batch": BATCH, "micro_batch": micro, "seq_len": SEQ},
                      "health": {"nan": {"policy": "skip"}}})  # the guard that drops on device
    step = wrap(loss_step(loss_fn), spec, build_mesh(spec, jax.devices()[:2]), nan_guard=nan_guard)
    init = lambda w: TrainState.create(apply_fn=None, params={"w": w}, tx=SGD)  # noqa: E731
    return step, init


@pytest.fixture(scope="module")
def accumulated_step():
    step, init = _wrapped()
    w = np.random.default_rng(1).standard_normal(DIM).astype(np.float32)
    state = step.init(init, w)
    new_state, metrics = step(state, _batch())
    return w, np.asarray(new_state.params["w"]), jax.device_get(metrics)


def test_accumulated_step_follows_the_token_weighted_reference(accumulated_step):
    """float32 sums of at most 40 terms against float64: rtol 1e-5 is ~100x the rounding."""
    w, new_w, metrics = accumulated_step
    sums, tokens, grads = zip(*_reference_parts(w.astype(np.float64), _batch()))
    loss, grad = token_weighted(sums, tokens, grads)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(w - new_w, grad, rtol=1e-5, atol=1e-6)  # sgd(1.0): w - grad
    # The comparison discriminates: the rule the spec rejects misses by far more.
    assert abs(mean_of_means(sums, tokens) - loss) > 1e-3 * abs(loss)


def test_without_nan_guard_the_step_output_is_unchanged():
    guarded, init = _wrapped(micro=BATCH)
    plain, _ = _wrapped(nan_guard=False, micro=BATCH)
    bad = _batch()
    bad["x"][0, 0, 0] = np.nan
    w = np.ones(DIM, np.float32)
    kept, metrics = guarded(guarded.init(init, w), bad)
    np.testing.assert_array_equal(np.asarray(kept.params["w"]), w)  # update dropped
    assert int(metrics["nonfinite"]) == 1 and guarded.check_nonfinite() == 1
    taken, metrics = plain(plain.init(init, w), bad)
    assert np.isnan(np.asarray(taken.params["w"])).any() and int(taken.step) == 1
    assert "nonfinite" not in metrics and plain.check_nonfinite() == 0


def test_cost_analysis_sees_every_micro_batch():
    """XLA counts a loop body once: the accumulating step's own count is about one micro-batch;
    the program lowered for cost analysis has no loop and counts the whole batch."""
    step, init = _wrapped()
    state = step.init(init, np.ones(DIM, np.float32))
    looped = step.lower(state, _batch()).cost_analysis()["flops"]
    whole = step.lower_for_cost_analysis(state, _batch()).cost_analysis()["flops"]
    assert whole > 2 * looped


@pytest.mark.parametrize("loss_fn, returned", [
    (lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), r"it returned float32\[\]"),  # a bare mean
    (lambda p, b: (jnp.sum(b["x"] @ p["w"]), b["mask"], {}), r"its valid_tokens is float32\[\d,5\]"),
    (lambda p, b: (jnp.sum(b["x"] @ p["w"]), True, {}), "its valid_tokens is bool"),
    (lambda p, b: (b["x"] @ p["w"], jnp.sum(b["mask"]), {}), r"its loss_sum is float32\[\d,5\]"),
    (lambda p, b: (jnp.sum(b["x"] @ p["w"]), jnp.sum(b["mask"])), "it returned tuple of 2"),
])
def test_a_wrong_loss_fn_return_is_one_line_saying_what_is_expected(loss_fn, returned):
    """Called directly (no trainspec) and wrapped alike: one line naming the expected
    (loss_sum, valid_tokens, aux) and what came back, instead of an AttributeError or
    TypeError from inside the accumulation."""
    wrapped, init = _wrapped(loss_fn=loss_fn)
    state = init(np.ones(DIM, np.float32))
    for call, first in ((loss_step(loss_fn), state), (wrapped, wrapped.init(init, state.params["w"]))):
        with pytest.raises(UserInputError) as err:
            call(first, _batch())
        message = str(err.value)
        assert "\n" not in message and re.search(f"; {returned}$", message), message
        assert message.startswith("loss_fn(params, batch) must return (loss_sum, valid_tokens, aux)")


def test_a_python_token_count_trains_as_the_same_count_in_an_array():
    """valid_tokens as a Python int (a count from shapes, as torch's wrap takes it) is the
    same step as that count in an array: both frameworks accept the same types."""
    def counted(as_int):
        def loss_fn(params, batch):
            err = batch["x"] @ params["w"] - batch["y"]
            count = batch["y"].size
            return 0.5 * jnp.sum(err * err), count if as_int else jnp.float32(count), {}
        step, init = _wrapped(loss_fn=loss_fn)
        return step(step.init(init, np.ones(DIM, np.float32)), _batch())
    (with_int, int_metrics), (with_array, array_metrics) = counted(True), counted(False)
    assert float(int_metrics["valid_tokens"]) == BATCH * SEQ
    np.testing.assert_array_equal(with_int.params["w"], with_array.params["w"])
