"""health.nan: a NaN batch is dropped inside the step (skip) or halts with the good state kept."""
import jax
import numpy as np
import pytest

from spec_jax.core.health import HealthHalt
from spec_jax.train import build_job

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
