"""What the trunk decides about semi-synchronous training ([semi_sync], docs/communication.md),
whichever backend runs the groups: how a step's record is made of the groups' own values.

Each data-parallel group trains on its own between exchanges, so a step's metrics reach the
host one value per group (a leading axis of the groups); the backends gather them at records
only, never inside the step.
"""
from __future__ import annotations

import numpy as np


def combine_groups(metrics: dict) -> dict:
    """The record's values from the groups' (on the host), or `metrics` unchanged where they
    are one step's already (no `loss_tokens`: not per group).

    `loss` token-weighted over all groups (each on its own parameters); `valid_tokens` and
    `aux` summed; `grad_norm` the root mean square of the groups' own norms; `nonfinite` 1 if
    any group dropped its step; `skipped_steps` the most steps any one group dropped; any other
    value is the same in every group (the schedule's learning rate): the first group's."""
    if "loss_tokens" not in metrics:
        return metrics
    per_group = dict(metrics)
    weights = np.asarray(per_group.pop("loss_tokens"), np.float64)
    losses = np.asarray(per_group.pop("loss"))
    combined = {
        "loss": losses.dtype.type(np.sum(losses * weights) / max(np.sum(weights), 1.0)),
        "valid_tokens": np.sum(per_group.pop("valid_tokens")),
        "grad_norm": np.sqrt(np.mean(np.square(per_group.pop("grad_norm")))),
    }
    if "aux" in per_group:
        combined["aux"] = _sum_over_groups(per_group.pop("aux"))
    for name in ("nonfinite", "skipped_steps"):
        if name in per_group:
            combined[name] = int(np.max(per_group.pop(name)))
    return {**{name: np.asarray(values)[0] for name, values in per_group.items()}, **combined}


def stack_groups(per_group: list[dict]) -> dict:
    """The groups' metrics (one dict per group, as each computed them) as one dict of values
    with a leading axis of the groups, nested dicts (a user's aux) stacked leaf by leaf."""
    first = per_group[0]
    if isinstance(first, dict):
        return {key: stack_groups([group[key] for group in per_group]) for key in first}
    return np.stack([np.asarray(value) for value in per_group])


def _sum_over_groups(tree):
    """Each leaf of a user's aux tree (dicts, lists, tuples of arrays) summed over its groups."""
    if isinstance(tree, dict):
        return {key: _sum_over_groups(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_sum_over_groups(value) for value in tree)
    return np.sum(tree, axis=0)
