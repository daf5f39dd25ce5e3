"""Checks on the state a user's `init_fn` builds, with messages that say what to change.

- `init_fn` must build the same pytree every call: the step is jitted against the shardings
  planned from one call, and a static field that is a new object each time (an optax
  optimizer or a model built inside `init_fn`) makes jax refuse the next one.
- Leaves without flax logical axis names are replicated; when none has names although the
  mesh could shard them (an `fsdp` or `tensor` axis larger than 1), say how many there are.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from trainspec.core.errors import UserInputError
from trainspec.core.mesh import ParallelDims


def _static_fields(node) -> list[tuple[str, Any, bool]]:
    """(name, value, is_pytree_child) for the fields of a dataclass pytree node (flax struct)."""
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return []
    return [(f.name, getattr(node, f.name), f.metadata.get("pytree_node", True))
            for f in dataclasses.fields(node)]


def first_static_difference(a, b, path: str = "state") -> str | None:
    """Where two pytrees of the same kind differ in static (non-leaf) data, e.g. `state.tx`."""
    if type(a) is not type(b):
        return f"{path} ({type(a).__name__} vs {type(b).__name__})"
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"{path} (keys {sorted(map(str, a))} vs {sorted(map(str, b))})"
        children = [(f"{path}[{k!r}]", a[k], b[k]) for k in a]
    elif isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
        if len(a) != len(b):
            return f"{path} (length {len(a)} vs {len(b)})"
        children = [(f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b))]
    else:
        children = []
        for (name, x, child), (_, y, _) in zip(_static_fields(a), _static_fields(b)):
            if child:
                children.append((f"{path}.{name}", x, y))
            elif x != y:
                return f"{path}.{name} (a new {type(x).__name__} each call)"
    for child_path, x, y in children:
        found = first_static_difference(x, y, child_path)
        if found:
            return found
    return None


def check_same_structure(planned, built) -> None:
    """Raise a one-line UserInputError when `init_fn` built a different pytree than planned."""
    if jax.tree.structure(planned) == jax.tree.structure(built):
        return
    where = first_static_difference(planned, built) or "the state's pytree structure"
    raise UserInputError(
        f"init_fn: {where} differs between two calls of init_fn, so the state cannot keep "
        "the shardings planned for it; create the model and the optax optimizer once, outside "
        "init_fn, and refer to those objects inside it")


def warn_unannotated(abstract_boxed_state, dims: ParallelDims) -> None:
    """Warn when a mesh that could shard parameters finds leaves with no logical names."""
    # pure data parallelism replicates the state anyway; a pipeline axis splits the blocks
    # by stage whatever their names (trainspec.jax.pipeline_params)
    shardable = tuple(a for a in dims.split_beside("data")
                      if a not in dims.axes_with_role("pipeline"))
    if not shardable:
        return
    # flax gives an unboxed array P() and a boxed one a name (or None) per dimension.
    logical = jax.tree.leaves(nn.get_partition_spec(abstract_boxed_state),
                              is_leaf=lambda x: isinstance(x, P))
    ndims = [np.ndim(x) for x in jax.tree.leaves(abstract_boxed_state)]
    bare = sum(1 for names, ndim in zip(logical, ndims) if ndim > 0 and len(names) == 0)
    # A model that names some dimensions chose what to leave replicated (biases, norms);
    # one that names none has most likely lost its names (nn.unbox in init_fn).
    if bare and bare == sum(1 for ndim in ndims if ndim > 0):
        warnings.warn(
            f"init_fn: {bare} of {len(ndims)} state leaves carry no logical axis names, so "
            f"they are replicated over mesh axes {', '.join(shardable)}; return the params "
            "boxed by nn.with_logical_partitioning (do not nn.unbox them in init_fn) to shard "
            "them by the layout rules", UserWarning, stacklevel=3)
