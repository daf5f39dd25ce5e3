"""A semi-synchronous step's record is made of the groups' values by the trunk, one rule for
every backend (trainspec.core.semi_sync): token-weighted loss, summed tokens and aux, the root
mean square of the groups' gradient norms, the worst group's non-finite flag and skip count."""
import numpy as np
import pytest

from trainspec.core.semi_sync import combine_groups, stack_groups

GROUPS = [  # each group's own metrics, as a torch rank or a JAX group computes them
    {"loss": 2.0, "loss_tokens": 30.0, "valid_tokens": 30.0, "grad_norm": 3.0,
     "nonfinite": 0, "skipped_steps": 1, "learning_rate": 0.1,
     "aux": {"moe": {"dropped": 4.0}, "pair": (1.0, 2.0)}},
    {"loss": 5.0, "loss_tokens": 10.0, "valid_tokens": 10.0, "grad_norm": 4.0,
     "nonfinite": 1, "skipped_steps": 2, "learning_rate": 0.1,
     "aux": {"moe": {"dropped": 6.0}, "pair": (10.0, 20.0)}},
]


def test_the_groups_combine_by_the_trunks_rule():
    combined = combine_groups(stack_groups(GROUPS))
    assert combined["loss"] == pytest.approx((2.0 * 30 + 5.0 * 10) / 40)  # token-weighted
    assert combined["valid_tokens"] == 40.0
    assert combined["grad_norm"] == pytest.approx(np.sqrt((9 + 16) / 2))
    assert combined["nonfinite"] == 1 and combined["skipped_steps"] == 2
    assert combined["aux"]["moe"]["dropped"] == 10.0
    assert tuple(combined["aux"]["pair"]) == (11.0, 22.0)
    assert combined["learning_rate"] == pytest.approx(0.1)
    assert "loss_tokens" not in combined


def test_a_synchronous_steps_metrics_pass_unchanged():
    one = {"loss": 2.0, "valid_tokens": 30.0, "grad_norm": 3.0}
    assert combine_groups(one) is one


def test_backends_use_the_trunks_rule():
    """Neither backend keeps a combining rule of its own."""
    import inspect

    import trainspec.jax.semi_sync
    import trainspec.torch.engine

    for module in (trainspec.jax.semi_sync, trainspec.torch.engine):
        assert "def combine_metrics" not in inspect.getsource(module)
