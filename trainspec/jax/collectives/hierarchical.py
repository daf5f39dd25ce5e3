"""The `hierarchical` backend: Horovod's hierarchical all-reduce over jax's multi-process runtime.

A group (`axis_name`, one mesh axis or a tuple) is split into its *in-process* axes (every
device along the axis belongs to the same process) and its *cross-process* axes (the rest). An
all-reduce then runs in three stages:

  1. reduce-scatter over the in-process axes with the `ext` backend (xla_ext custom calls,
     in-process rendezvous, rank-order sums): each device ends with 1/n_in of the local sum;
  2. all-reduce of that shard over the cross-process axes with the native runtime (lax.psum:
     gloo on CPU, NCCL on GPU), so only 1/n_in of the buffer crosses the slow links per device;
  3. all-gather over the in-process axes with `ext`.

The other ops, and why:
  - reduce_scatter: stage 1 then a lax psum_scatter across processes (blocks are permuted first
    so that member k still gets block k of the row-major group rank);
  - all_gather: ext all_gather within, lax all_gather across, blocks put back in rank order;
  - broadcast: ext broadcast from root's in-process coordinate, then the xla backend's
    broadcast across processes from root's process coordinate; both only move data (exact);
  - all_reduce max/min: ext within, lax across (exact, no reduce-scatter needed);
  - all_to_all and permute: `ext` when the group is in-process, else the `xla` backend over
    the whole group. Their data does not shrink at any stage, so a two-stage version moves the
    same bytes across processes; the win would only be fewer, larger cross-process messages,
    not worth a second implementation here.

Which axes are in-process is read from the concrete mesh (`jax.set_mesh(mesh)` while tracing,
as the train step does); in a single process every axis is in-process (then this is `ext`).
With several processes and no concrete mesh the op fails at trace time rather than guess.
An axis that is neither (it spans processes *and* devices within one) counts as cross-process:
correct, but the hierarchy is lost on it; the train step refuses such a mesh (step.py).

16-bit floating sums accumulate in float32 across all three stages and round once at the end,
as the API requires; that doubles the bytes moved for them. Gradients compose from the stages'
own rules (ext custom VJPs, lax transposes); use `shard_map(..., check_vma=False)` as with ext.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.mesh import get_concrete_mesh  # no public accessor in jax 0.10.2

from trainspec.jax.collectives import ext, xla
from trainspec.jax.collectives.api import HALF_FLOATS
from trainspec.jax.mesh import process_grid

SUPPORTED_DTYPES = ext.SUPPORTED_DTYPES  # its in-process stages are ext's


def _names(axis_name) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def in_process_axes(mesh) -> set[str]:
    """Axes of a concrete mesh along which every step stays in the same process."""
    procs = process_grid(mesh)
    return {a for i, a in enumerate(mesh.axis_names)
            if np.all(procs == np.take(procs, [0], axis=i))}


def split(axis_name) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(group axes, in-process axes, cross-process axes), the last two in group order."""
    names = _names(axis_name)
    mesh = get_concrete_mesh()
    if mesh is None or mesh.empty:
        if jax.process_count() > 1:
            raise ValueError(
                "hierarchical collectives need the concrete mesh to tell in-process axes from "
                "cross-process ones: trace under `with jax.set_mesh(mesh):`")
        inside = set(names)
    else:
        inside = in_process_axes(mesh)
    return names, tuple(a for a in names if a in inside), tuple(a for a in names if a not in inside)


def _size(axes) -> int:
    return math.prod(lax.axis_size(a) for a in axes)


def _widen(x):
    """16-bit floats are summed in float32 end to end and rounded once (API requirement)."""
    x = jnp.asarray(x)
    return (x.astype(jnp.float32) if x.dtype in HALF_FLOATS else x), x.dtype


def _permute_blocks(x, dim: int, sizes, order):
    """Split `dim` into (sizes..., rest), reorder the size sub-dimensions by `order`, merge."""
    lead, rest = x.shape[:dim], x.shape[dim + 1:]
    y = x.reshape(lead + tuple(sizes) + (x.shape[dim] // math.prod(sizes),) + rest)
    k = len(sizes)
    perm = (list(range(dim)) + [dim + i for i in order] + [dim + k]
            + list(range(dim + k + 1, y.ndim)))
    return y.transpose(perm).reshape(x.shape)


def all_reduce(x, axis_name, op="sum", *, timeout_s=None, in_place=False):
    # `in_place` reaches only the all-ext case: across processes the stages change the shape
    # (scatter, gather) or are XLA's, whose buffer assignment places the result.
    names, inner, outer = split(axis_name)
    if not outer:
        return ext.all_reduce(x, inner, op, timeout_s=timeout_s, in_place=in_place)
    if not inner:
        return xla.all_reduce(x, outer, op)
    if op in ("max", "min"):  # exact in any order: no need to scatter
        return xla.all_reduce(ext.all_reduce(x, inner, op, timeout_s=timeout_s), outer, op)
    wide, dtype = _widen(x)
    n_in = _size(inner)
    flat = wide.reshape(-1)
    padded = jnp.pad(flat, (0, -flat.size % n_in))  # reduce_scatter needs a multiple of n_in
    part = ext.reduce_scatter(padded, inner, op="sum", timeout_s=timeout_s)
    part = lax.psum(part, outer)
    total = ext.all_gather(part, inner, axis=0, timeout_s=timeout_s)[:flat.size].reshape(wide.shape)
    if op == "mean":  # a Python int keeps the dtype; exact when the group size is a power of 2
        total = total / _size(names)
    return total.astype(dtype)


def reduce_scatter(x, axis_name, *, scatter_dimension=0, op="sum", timeout_s=None):
    names, inner, outer = split(axis_name)
    if not outer:
        return ext.reduce_scatter(x, inner, scatter_dimension=scatter_dimension, op=op,
                                  timeout_s=timeout_s)
    if not inner:
        return xla.reduce_scatter(x, outer, scatter_dimension=scatter_dimension, op=op)
    wide, dtype = _widen(x)
    d = scatter_dimension % wide.ndim
    # Member k = row-major rank over `names` must get block k. Order the blocks so that the
    # in-process coordinates are major: ext's scatter then leaves each device the blocks of its
    # in-process coordinate for every process coordinate, which the lax scatter splits last.
    sizes = [lax.axis_size(a) for a in names]
    order = [names.index(a) for a in inner + outer]
    blocks = _permute_blocks(wide, d, sizes, order)
    part = ext.reduce_scatter(blocks, inner, scatter_dimension=d, op="sum", timeout_s=timeout_s)
    out = lax.psum_scatter(part, outer, scatter_dimension=d, tiled=True)
    if op == "mean":
        out = out / _size(names)
    return out.astype(dtype)


def all_gather(x, axis_name, *, axis=0, timeout_s=None):
    names, inner, outer = split(axis_name)
    if not outer:
        return ext.all_gather(x, inner, axis=axis, timeout_s=timeout_s)
    if not inner:
        return xla.all_gather(x, outer, axis=axis)
    x = jnp.asarray(x)
    a = axis % x.ndim
    stacked = ext.all_gather(x[None], inner, axis=0, timeout_s=timeout_s)  # (n_in, *x.shape)
    stacked = lax.all_gather(stacked, outer, axis=0, tiled=True)  # (n_out * n_in, *x.shape)
    # Leading index is (outer coords..., inner coords...) row-major: reorder to group rank.
    sub = [lax.axis_size(n) for n in outer + inner]
    order = [(outer + inner).index(n) for n in names]
    members = stacked.reshape(*sub, *x.shape).transpose(
        *order, *range(len(sub), len(sub) + x.ndim)).reshape(-1, *x.shape)
    n = members.shape[0]
    return jnp.moveaxis(members, 0, a).reshape(x.shape[:a] + (n * x.shape[a],) + x.shape[a + 1:])


def broadcast(x, axis_name, root=0, *, timeout_s=None):
    names, inner, outer = split(axis_name)
    if not outer:
        return ext.broadcast(x, inner, root, timeout_s=timeout_s)
    if not inner:
        return xla.broadcast(x, outer, root)
    coords = dict(zip(names, np.unravel_index(root, [lax.axis_size(a) for a in names])))
    rank_in = int(np.ravel_multi_index([coords[a] for a in inner], [lax.axis_size(a) for a in inner]))
    rank_out = int(np.ravel_multi_index([coords[a] for a in outer], [lax.axis_size(a) for a in outer]))
    # After the first stage every device of root's process holds root's x; the second stage
    # sends it from there to the device with the same in-process coordinate everywhere else.
    local = ext.broadcast(x, inner, rank_in, timeout_s=timeout_s)
    return xla.broadcast(local, outer, rank_out)


def all_to_all(x, axis_name, split_axis, concat_axis, *, timeout_s=None):
    if not split(axis_name)[2]:
        return ext.all_to_all(x, axis_name, split_axis, concat_axis, timeout_s=timeout_s)
    return xla.all_to_all(x, axis_name, split_axis, concat_axis)


def permute(x, axis_name, perm, *, timeout_s=None):
    if not split(axis_name)[2]:
        return ext.permute(x, axis_name, perm, timeout_s=timeout_s)
    return xla.permute(x, axis_name, perm)
