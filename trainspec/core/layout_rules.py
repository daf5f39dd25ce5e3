"""Logical-axis rules in plain names: which mesh axes each logical axis of a model is split over.

Used by the JAX layout (trainspec.jax.layout) and by the planner (trainspec.core.plan), which must
agree on where every parameter lives.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec

# Which roles each conventional logical axis is sharded over by default (docs/spec.md).
DEFAULT_ROLE_RULES = {
    "batch": ("data", "fsdp", "expert"),  # an expert axis splits the batch as a data axis
    "length": ("context",),
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv": (),
    "vocab": ("tensor",),
    "layers": (),
    "expert": ("expert",),
}


def logical_rules(spec: Spec, without: Sequence[str] = ()) -> dict[str, tuple[str, ...]]:
    """Logical axis -> mesh axes: role defaults, overridden by `layout.rules`.

    `without` drops mesh axes that the caller handles itself (e.g. the data axes inside a
    computation vmapped over replicas).
    """
    rules = {
        logical: tuple(a for role in roles for a in spec.mesh.axes_with_role(role))
        for logical, roles in DEFAULT_ROLE_RULES.items()
    }
    rules.update({logical: tuple(axes) for logical, axes in spec.layout.rules.items()})
    return {logical: tuple(a for a in axes if a not in without) for logical, axes in rules.items()}


def dim_axes(rules: Mapping[str, tuple[str, ...]], logical: str | None, dim_size: int,
             mesh_shape: Mapping[str, int], used: set[str]) -> tuple[str, ...]:
    """Mesh axes one dimension is split over: size-1 and already-used axes dropped; an uneven
    split is replicated rather than padded (docs/spec.md). Adds the axes to `used`."""
    if logical is None:
        return ()
    if logical not in rules:
        raise UserInputError(f"logical axis '{logical}' has no rule (known: {', '.join(rules)}); "
                             f"add it to layout.rules, e.g. layout.rules.{logical} = []")
    axes = tuple(a for a in rules[logical] if a not in used and mesh_shape[a] > 1)
    if not axes or dim_size % math.prod(mesh_shape[a] for a in axes):
        return ()
    used.update(axes)
    return axes
