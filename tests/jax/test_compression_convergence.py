"""collectives.compression trains like synchronous training, over the same tokens.

The margin is measured here, not assumed: the spread of the synchronous run's final loss over
three initialisation seeds (same tokens). Each compressed option, from seed 0, must end within
that margin of the synchronous run from seed 0. (What error feedback is worth at these sizes,
and where its absence fails: tests/jax/test_error_feedback_matters.py, docs/communication.md.)
"""
import pytest

from trainspec.jax.tools.communication import CompiledOption, margin_from_seeds
from tiny import tiny_spec

pytestmark = pytest.mark.slow

STEPS, LAST = 40, 10  # final loss: the mean of the last 10 steps (one batch is noisy)
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def synchronous():
    option = CompiledOption("none", tiny_spec())
    runs = [option.train(seed, STEPS) for seed in SEEDS]
    return runs[0], margin_from_seeds(runs, LAST)


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_compressed_training_ends_within_the_seed_spread(compression, synchronous):
    reference, margin = synchronous
    assert margin > 0
    spec = tiny_spec(f'collectives.compression="{compression}"')
    run = CompiledOption(compression, spec).train(SEEDS[0], STEPS)
    assert run.losses != reference.losses  # compression changed the sums: the test tests it
    gap = abs(run.final_loss(LAST) - reference.final_loss(LAST))
    assert gap <= margin, (compression, gap, margin)
