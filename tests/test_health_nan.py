"""health.nan: a NaN batch is dropped inside the step (skip) or halts with the good state kept."""
import jax
import numpy as np
import pytest

from spec_jax.checkpoint import Checkpointer
from spec_jax.core.errors import UserInputError
from spec_jax.core.health import HealthHalt
from spec_jax.health.faults import Faults
from spec_jax.train import build_job, run

from tiny import tiny_spec


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
    spec = tiny_spec("health.nan.max_consecutive_skips=2")
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
    assert ckpt.good_steps() == [0]
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
    spec = tiny_spec("health.nan.max_consecutive_skips=3", "checkpoint.interval=4",
                     "checkpoint.async_save=false")
    first = run(spec, tmp_path, steps=4, progress=False, faults=Faults(nan_steps=frozenset({3, 4})))
    assert first["skipped_steps"] == 2
    with pytest.raises(HealthHalt, match=r"at step 6 .*max_consecutive_skips = 3"):
        run(spec, tmp_path, steps=8, progress=False, faults=Faults(nan_steps=frozenset({5, 6})))
