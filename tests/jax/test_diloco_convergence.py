"""DiLoCo trains the default model like synchronous training, over the same tokens.

The default job (trainspec/default.toml, 60 steps) itself, not the tiny model: what DiLoCo costs
in loss per token depends on each group's batch, and the tiny model's does not show it. The
margin is measured here: the spread of the synchronous final loss over three seeds, each setting
initialisation and data order as the spec's `seed` does (docs/communication.md's table has the
same margin; the init-only spread, 0.010 here, is narrower than DiLoCo's gap, +0.012 at H = 4).
DiLoCo, like synchronous seed 0, trains on seed 0's tokens. DiLoCo runs as 2 groups of 4 devices (fsdp inside each group, 16 of the 32
sequences per group) with the outer step docs/communication.md recommends for a run of a few
rounds (lr 0.8, Nesterov momentum 0.4); that page also gives the settings that miss (8 groups
of one device; the long-run outer step 0.7/0.9 over 15 rounds).
"""
import pytest

from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.jax.tools.communication import CompiledOption, margin_from_seeds
from tiny import LAYOUTS

pytestmark = [pytest.mark.slow, pytest.mark.optimised]

STEPS, LAST = 60, 10  # the default job; final loss: the mean of the last 10 steps
SEEDS = (0, 1, 2)
OUTER = ("semi_sync.outer_lr=0.8", "semi_sync.outer_momentum=0.4")


@pytest.fixture(scope="module")
def synchronous():
    option = CompiledOption("synchronous", load_spec(DEFAULT_SPEC_PATH))
    runs = [option.train(seed, STEPS, seed_data=True) for seed in SEEDS]
    return runs[0], margin_from_seeds(runs, LAST)


@pytest.mark.parametrize("inner_steps", [4, 16])
def test_diloco_ends_within_the_seed_spread(inner_steps, synchronous):
    reference, margin = synchronous
    spec = load_spec(DEFAULT_SPEC_PATH, [*LAYOUTS["fsdp4"], f"semi_sync.inner_steps={inner_steps}",
                                         *OUTER])
    run = CompiledOption(f"DiLoCo H={inner_steps}", spec).train(SEEDS[0], STEPS)
    assert run.losses[-1] != reference.losses[-1]  # the groups drifted apart: DiLoCo ran
    gap = abs(run.final_loss(LAST) - reference.final_loss(LAST))
    print(f"DiLoCo H={inner_steps}: gap {gap:+.4f}, margin {margin:.4f}")
    assert gap <= margin, (inner_steps, gap, margin)


def test_diloco_of_8_one_device_groups_with_the_long_run_outer_step_misses_it(synchronous):
    """The check can fail, where docs/communication.md says DiLoCo costs loss per token: 8
    groups of 4 sequences each and the outer step meant for hundreds of rounds (0.7, 0.9)."""
    reference, margin = synchronous
    spec = load_spec(DEFAULT_SPEC_PATH, ["semi_sync.inner_steps=4"])
    run = CompiledOption("DiLoCo H=4, 8 groups", spec).train(SEEDS[0], STEPS)
    assert run.final_loss(LAST) - reference.final_loss(LAST) > margin
