"""health.nan's opt-in on-device policies: a NaN batch is dropped inside the step (skip) or
halts with the good state kept (the default, rollback, is tested in test_rollback.py)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import trainspec.jax

from trainspec.jax.checkpoint import Checkpointer
from trainspec.core.errors import UserInputError
from trainspec.core.health import HealthHalt
from trainspec.jax.health.faults import Faults
from trainspec.jax.train import build_job, run

from tiny import tiny_spec

pytestmark = pytest.mark.slow


def _poison(batch):
    """NaN in a float input: the mask multiplies the per-token loss, so loss and grads go NaN."""
    return {**batch, "mask": np.full_like(batch["mask"], np.nan)}


def _params(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


def test_skip_drops_the_update_and_counts_it():
    spec = tiny_spec("health.nan.policy='skip'")
    job = build_job(spec, total_steps=4)
    s0 = job.state
    s1, _ = job.step(s0, job.data.batch(0))
    before = _params(s1)
    s2, m = job.step(s1, _poison(job.data.batch(1)))
    assert int(m["nonfinite"]) == 1 and int(m["skipped_steps"]) == 1
    for a, b in zip(before, _params(s2)):  # bit for bit the state before the NaN step
        np.testing.assert_array_equal(a, b)
    s3, m = job.step(s2, job.data.batch(2))  # training goes on, finite
    assert int(m["nonfinite"]) == 0 and int(m["skipped_steps"]) == 1
    assert all(np.isfinite(p).all() for p in _params(s3))
    assert job.step.check_nonfinite() == 1  # no halt


def test_skip_limit_halts_after_too_many_in_a_row():
    spec = tiny_spec("health.nan.policy='skip'", "health.nan.max_consecutive_skips=2")
    job = build_job(spec, total_steps=6)
    state = job.state
    for i in range(5):  # steps 2..5 (1-based) are NaN: the third in a row (step 4) trips
        batch = job.data.batch(i)
        state, _ = job.step(state, _poison(batch) if i >= 1 else batch)
    with pytest.raises(HealthHalt, match="at step 4 .*max_consecutive_skips = 2") as err:
        job.step.check_nonfinite()
    assert err.value.last_good_step == 3


def test_halt_freezes_state_at_the_last_good_step():
    spec = tiny_spec("health.nan.policy='halt'")
    job = build_job(spec, total_steps=5)
    state = job.state
    state, _ = job.step(state, job.data.batch(0))
    good = _params(state)
    state, _ = job.step(state, _poison(job.data.batch(1)))
    # the host has not looked yet: later finite steps are dispatched but must not move the state
    state, _ = job.step(state, job.data.batch(2))
    for a, b in zip(good, _params(state)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(HealthHalt, match="at step 2 .*policy = halt") as err:
        job.step.check_nonfinite()
    assert err.value.last_good_step == 1


def _unvalidated(spec, **optimizer):
    """The spec with optimizer fields that validation refuses (to test the guard behind it)."""
    return spec.model_copy(update={"optimizer": spec.optimizer.model_copy(update=optimizer)})


def test_infinite_learning_rate_is_refused_by_validation():
    with pytest.raises(UserInputError, match="optimizer.learning_rate.*finite"):
        tiny_spec("optimizer.learning_rate=inf")
    with pytest.raises(UserInputError, match="optimizer.learning_rate"):
        tiny_spec("optimizer.learning_rate=1e30")


def test_nan_in_the_updated_state_is_caught_before_any_checkpoint_holds_it(tmp_path):
    """Finite loss and gradients, NaN parameters after the update: the guard checks the new
    state on device, so the halt keeps (and checkpoints) the state before step 1."""
    spec = _unvalidated(tiny_spec("health.nan.policy='halt'", "checkpoint.interval=2",
                                  "checkpoint.async_save=false"), learning_rate=float("inf"))
    with pytest.raises(HealthHalt, match=r"at step 1 .*state after step 0 is checkpoint 0"):
        run(spec, tmp_path, steps=4, progress=False)
    ckpt = Checkpointer(spec, tmp_path)
    assert ckpt.steps() == [0]
    state, _ = ckpt.restore_latest(build_job(spec, init=False).abstract_state)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def test_halt_without_checkpoints_says_nothing_was_kept(tmp_path):
    spec = tiny_spec("health.nan.policy='halt'", "checkpoint.interval=0")
    with pytest.raises(HealthHalt, match=r"at step 2 .*no checkpoint kept a state") as err:
        run(spec, tmp_path, steps=4, progress=False, faults=Faults(nan_steps=frozenset({2})))
    assert "kept" not in str(err.value).split(";")[0]


def test_consecutive_nonfinite_steps_count_across_a_resume(tmp_path):
    """Steps 3-4 non-finite, checkpoint at 4, resume, steps 5-6 non-finite: 4 in a row is over
    max_consecutive_skips = 3 although neither run alone saw more than 2."""
    spec = tiny_spec("health.nan.policy='skip'", "health.nan.max_consecutive_skips=3",
                     "checkpoint.interval=4",
                     "checkpoint.async_save=false")
    first = run(spec, tmp_path, steps=4, progress=False, faults=Faults(nan_steps=frozenset({3, 4})))
    assert first["skipped_steps"] == 2
    with pytest.raises(HealthHalt, match=r"at step 6 .*max_consecutive_skips = 3"):
        run(spec, tmp_path, steps=8, progress=False, faults=Faults(nan_steps=frozenset({5, 6})))


class _Odd(nn.Module):
    """A kernel split by fsdp/tensor where the layout says so, an odd-sized replicated leaf."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.with_logical_partitioning(
            nn.initializers.normal(), ("embed", "mlp")), (16, 24))
        odd = self.param("odd", nn.initializers.normal(), (6, 5))  # 30 = 7 slices of 4 + 2
        return x @ kernel + jnp.sum(odd)


@pytest.mark.parametrize("layout", ["data", "fsdp2", "tensor"])
def test_one_nan_element_anywhere_on_any_layout_drops_the_step(layout):
    """Each device checks only a slice of its block of each leaf. One NaN or infinite element
    of the new state, first, inside or last of its leaf (the last slices overlap a neighbour),
    in a leaf split by the layout or replicated, drops the step: params, optimizer moments and
    step count stay exactly as they were."""
    spec = tiny_spec("health.nan.policy='skip'", layout=layout)
    model, optimizer = _Odd(), optax.adam(1e-2)

    def init(key):
        params = model.init(key, jnp.zeros((1, 16)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optimizer)

    def step(state, batch):  # batch["bad"][0] lands on element batch["at"][0] of a leaf
        grads = jax.grad(lambda p: jnp.sum(state.apply_fn({"params": p}, batch["x"]) ** 2))(
            state.params)
        new = state.apply_gradients(grads=grads)
        at, value = batch["at"][0], batch["bad"][0]
        poisoned = {name: (leaf.ravel().at[at % leaf.size].add(value).reshape(leaf.shape)
                           if name == batch_leaf else leaf)
                    for name, leaf in new.params.items()}
        return new.replace(params=poisoned), {"loss": jnp.float32(0)}

    rows = spec.batch.global_batch
    x = np.random.default_rng(0).normal(size=(rows, 16)).astype(np.float32)
    for batch_leaf in ("kernel", "odd"):
        wrapped = trainspec.jax.wrap(step, spec)
        state = wrapped.init(init, jax.random.key(0))
        clean = {"x": x, "at": np.zeros(rows, np.int32), "bad": np.zeros(rows, np.float32)}
        state, _ = wrapped(state, clean)
        for at, bad in ((0, np.nan), (13, np.inf), (-1, -np.inf), (13, np.nan)):
            before = [np.asarray(leaf) for leaf in jax.tree.leaves(state)]
            poison = {**clean, "at": np.full(rows, at, np.int32),
                      "bad": np.full(rows, bad, np.float32)}
            state, metrics = wrapped(state, poison)
            assert int(metrics["nonfinite"]) == 1
            for a, b in zip(before, jax.tree.leaves(state)):
                np.testing.assert_array_equal(a, np.asarray(b))
        assert int(state.step) == 1
        # A huge but finite element is kept: the check must not overflow on it.
        huge = {**clean, "at": np.full(rows, -1, np.int32),
                "bad": np.full(rows, 3e38, np.float32)}
        state, metrics = wrapped(state, huge)
        assert int(metrics["nonfinite"]) == 0 and int(state.step) == 2
