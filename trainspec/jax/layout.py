"""Logical-axis rules -> PartitionSpecs and NamedShardings for params, optimizer state and batch.

Models name their dimensions with logical axes (flax's `nn.with_logical_partitioning`); the spec
maps logical axes to mesh axes. Defaults come from the mesh axes' roles, so a model annotated
with the conventional names runs unchanged under any layout.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainspec.core.errors import UserInputError
from trainspec.core.layout_rules import DEFAULT_ROLE_RULES, dim_axes, logical_rules  # noqa: F401
from trainspec.core.spec import Spec


def flax_rules(spec: Spec, without: Sequence[str] = ()) -> list[tuple[str, tuple[str, ...] | None]]:
    """The same rules in the form `nn.logical_axis_rules` takes (for activation constraints)."""
    return [(logical, axes or None) for logical, axes in logical_rules(spec, without).items()]


def _mesh_axes_for_dim(rules, logical, dim_size, mesh: Mesh, used: set[str]):
    axes = dim_axes(rules, logical, dim_size, dict(mesh.shape), used)
    return None if not axes else axes if len(axes) > 1 else axes[0]


def to_partition_spec(logical: P, shape: Sequence[int], rules, mesh: Mesh) -> P:
    used: set[str] = set()
    names = tuple(logical) + (None,) * (len(shape) - len(logical))
    return P(*(_mesh_axes_for_dim(rules, n, s, mesh, used) for n, s in zip(names, shape)))


def add_axes_on_free_dim(pspec: P, shape: Sequence[int], axes: tuple[str, ...], mesh: Mesh) -> P:
    """`pspec` with its first free dimension that their sizes divide split over `axes` too
    (those of them that split and it does not use yet): ZeRO-1 over the data axes, a stored
    block over the pipeline axis (trainspec.jax.pipeline_params)."""
    free = tuple(a for a in axes if mesh.shape[a] > 1 and a not in mesh_axes_of(pspec))
    if not free:
        return pspec
    n = math.prod(mesh.shape[a] for a in free)
    entries = list(pspec) + [None] * (len(shape) - len(pspec))
    for i, (entry, size) in enumerate(zip(entries, shape)):
        if entry is None and size % n == 0:
            entries[i] = free if len(free) > 1 else free[0]
            return P(*entries)
    return pspec


def mesh_axes_of(pspec: P) -> set[str]:
    """Every mesh axis a PartitionSpec shards over."""
    used = set()
    for entry in pspec:
        if entry is not None:
            used.update((entry,) if isinstance(entry, str) else entry)
    return used


def gathered_for_use(weight, names: Sequence[str]):
    """A parameter (logical `names`) as a matmul uses it: gathered over the mesh axes that
    also split the batch (fsdp), its gradient constrained back to the stored layout (a
    reduce-scatter). One explicit gather serves the forward and the backward: left to XLA's
    SPMD partitioner, some weights are gathered again for the backward (docs/plan.md).
    Outside logical rules and a mesh (the model used on its own), and on a mesh whose axes are
    not all `Auto` (explicit sharding: the array's type says where it lives, and resharding it
    is the caller's), `weight` as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = {logical: (axes,) if isinstance(axes, str) else tuple(axes or ())
             for logical, axes in nn.get_logical_axis_rules()}
    if (mesh.empty or "batch" not in rules
            or any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types)):
        return weight
    stored = to_partition_spec(P(*names), weight.shape, rules, mesh)
    batch = set(rules["batch"]) & mesh_axes_of(stored)
    if not batch:
        return weight
    use = P(*(None if e is None else tuple(a for a in ((e,) if isinstance(e, str) else e)
                                           if a not in batch) or None for e in stored))
    return _gather(weight, stored, use)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(weight, stored: P, use: P):
    return jax.lax.with_sharding_constraint(weight, use)


def _gather_forward(weight, stored: P, use: P):
    return _gather(weight, stored, use), None


def _gather_backward(stored: P, use: P, _, grad):
    # A plain constraint's transpose would keep the gradient in the gathered layout: an
    # all-reduce over the batch axes where a reduce-scatter to the stored layout suffices.
    return (jax.lax.with_sharding_constraint(grad, stored),)


_gather.defvjp(_gather_forward, _gather_backward)


def strip_boxes(tree):
    """Remove flax metadata boxes without applying their sharding constraints.

    (`nn.meta.unbox` constrains each value, which fails outside a traced computation.)
    """
    return jax.tree.map(
        lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )


def state_partition_specs(abstract_boxed_state, spec: Spec, mesh: Mesh):
    """PartitionSpecs for a (possibly flax-boxed) abstract state pytree, unboxed structure.

    Leaves carrying logical names (nn.LogicallyPartitioned) follow the rules; the rest are
    replicated. With `layout.optimizer_state = "shard_over_data"`, leaves under an `opt_state`
    attribute are also sharded over the data axes.
    """
    rules = logical_rules(spec)
    logical = nn.get_partition_spec(abstract_boxed_state)
    shapes = strip_boxes(abstract_boxed_state)

    def leaf_spec(path, lg, leaf):
        try:
            return to_partition_spec(lg, leaf.shape, rules, mesh)
        except UserInputError as err:  # say which leaf names the axis
            raise UserInputError(f"state{jax.tree_util.keystr(path)}: {err}") from None

    pspecs = jax.tree_util.tree_map_with_path(leaf_spec, logical, shapes,
                                              is_leaf=lambda x: isinstance(x, P))
    if spec.layout.optimizer_state == "shard_over_data" and hasattr(pspecs, "opt_state"):
        data_axes = spec.mesh.axes_with_role("data")
        opt = jax.tree.map(
            lambda ps, leaf: add_axes_on_free_dim(ps, leaf.shape, data_axes, mesh),
            pspecs.opt_state,
            shapes.opt_state,
            is_leaf=lambda x: isinstance(x, P),
        )
        pspecs = pspecs.replace(opt_state=opt)
    return pspecs


def named(pspecs, mesh: Mesh):
    return jax.tree.map(lambda ps: NamedSharding(mesh, ps), pspecs, is_leaf=lambda x: isinstance(x, P))


def batch_partition_spec(spec: Spec, mesh: Mesh, ndim: int, without: Sequence[str] = ()) -> P:
    """Batch arrays are (batch, length, ...): dim 0 follows `batch`, dim 1 follows `length`."""
    rules = logical_rules(spec, without)
    entries = []
    used: set[str] = set()
    for logical in ("batch", "length")[:ndim]:
        axes = tuple(a for a in rules.get(logical, ()) if a not in used and mesh.shape[a] > 1)
        used.update(axes)
        entries.append(None if not axes else axes if len(axes) > 1 else axes[0])
    return P(*entries)


def batch_axes(spec: Spec, mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes that split the batch dimension (their product must divide the micro-batch)."""
    return tuple(a for a in logical_rules(spec)["batch"] if mesh.shape[a] > 1)


def describe(pspecs, abstract_state) -> list[str]:
    """One line per leaf: path, shape, PartitionSpec (for `trainspec validate`)."""
    lines = []
    flat_specs = jax.tree_util.tree_leaves_with_path(pspecs, is_leaf=lambda x: isinstance(x, P))
    flat_shapes = jax.tree.leaves(strip_boxes(abstract_state))
    for (path, ps), leaf in zip(flat_specs, flat_shapes):
        lines.append(f"{jax.tree_util.keystr(path):60s} {str(leaf.shape):18s} {ps}")
    return lines
