"""Straggler rule (median + k*MAD) on timings, and on a run with a delay injected."""
import numpy as np

from trainspec.jax.health.faults import Faults
from trainspec.core.health import StragglerDetector
from trainspec.core.spec_health import StragglerSpec
from trainspec.jax.train import run

from tiny import tiny_spec


def _feed(detector, times):
    for step, row in enumerate(times, 1):
        detector.observe(step, row)


def test_slow_participant_is_named():
    times = 0.1 + 0.005 * np.random.default_rng(0).random((30, 8))
    times[:, 6] += 0.05  # participant 6 is 50% slower
    d = StragglerDetector(StragglerSpec(window=10), [f"p{i}" for i in range(8)])
    _feed(d, times)
    assert d.stragglers() == ["p6"]
    assert d.report()["straggler_steps"]["p6"] >= 20


def test_jitter_is_not_a_straggler():
    d = StragglerDetector(StragglerSpec(window=10), [f"p{i}" for i in range(8)])
    _feed(d, 0.1 + 0.005 * np.random.default_rng(1).random((30, 8)))  # 5% jitter < min_excess 10%
    assert d.stragglers() == [] and d.slow_steps == []


def test_two_participants_cannot_name_one():
    """No majority: a median of two is their mean, neither is an outlier of it."""
    d = StragglerDetector(StragglerSpec(window=5), ["a", "b"])
    _feed(d, np.tile([0.1, 0.5], (10, 1)))
    assert d.stragglers() == []


def test_injected_delay_shows_as_slow_steps_in_the_run(tmp_path):
    """In one process the participant is the process: a delay at steps 12 and 15 is flagged."""
    spec = tiny_spec("checkpoint.interval=0", "metrics.interval=4", "health.stragglers.window=8")
    summary = run(spec, tmp_path, steps=16, progress=False,
                  faults=Faults(delay_s=0.3, delay_steps=frozenset({12, 15})))
    # other steps may be flagged too on a loaded machine (ms of dispatch jitter): only the
    # injected ones are required
    assert {12, 15} <= set(summary["slow_steps"])
