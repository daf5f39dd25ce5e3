"""The `xla` backend: the spec's collectives as XLA's own (lax) collectives.

Arguments are checked by `api.py` before they get here. `timeout_s` is accepted for a uniform
signature but not enforced: lax collectives have no per-op timeout (XLA's CPU runtime applies its
own rendezvous timeout). Gradients come from lax's transpose rules (psum <-> psum,
all_gather <-> psum_scatter, all_to_all <-> all_to_all, ppermute <-> inverse ppermute);
pmax/pmin have none in lax, so max/min are not differentiable on this backend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from trainspec.jax.collectives.api import HALF_FLOATS

_ALL_REDUCE = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}


def _in_f32(reduce, x, *args, **kwargs):
    """Sum 16-bit floats in float32 and round once, as the API requires of every backend.
    Measured on jaxlib 0.10.2 CPU: XLA already promotes bfloat16 all-reduces but sums float16
    in float16 (off by several ULPs over 8 members), and NCCL sums both in 16 bits."""
    x = jnp.asarray(x)
    if x.dtype not in HALF_FLOATS:
        return reduce(x, *args, **kwargs)
    return reduce(x.astype(jnp.float32), *args, **kwargs).astype(x.dtype)


def _nan_propagating(reduce, x, axis_name):
    """max/min with NaN propagated, as the spec requires (docs/spec.md, section 4). Measured
    on jaxlib 0.10.2 CPU: the all-reduce max/min drops a NaN (max(1, NaN) = 1 on some members,
    `trainspec conformance`'s special values); so a NaN flag is reduced beside the values."""
    x = jnp.asarray(x)
    out = reduce(x, axis_name)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return out
    any_nan = lax.pmax(jnp.isnan(x).astype(jnp.int32), axis_name)
    return jnp.where(any_nan > 0, jnp.asarray(jnp.nan, x.dtype), out)


def all_reduce(x, axis_name, op="sum", *, timeout_s=None, in_place=False):
    del in_place  # XLA's buffer assignment places the result (api.all_reduce)
    if op in ("max", "min"):  # exact in any dtype
        return _nan_propagating(_ALL_REDUCE[op], x, axis_name)
    return _in_f32(_ALL_REDUCE[op], x, axis_name)


def _psum_scatter_mean(x, axis_name, **kwargs):
    # Same arithmetic as lax.pmean: divide the sum by the (Python int) group size, which keeps
    # the dtype (weak typing) and is exact when the group size is a power of two.
    return lax.psum_scatter(x, axis_name, **kwargs) / lax.axis_size(axis_name)


def reduce_scatter(x, axis_name, *, scatter_dimension=0, op="sum", timeout_s=None):
    reduce = _psum_scatter_mean if op == "mean" else lax.psum_scatter
    return _in_f32(reduce, x, axis_name, scatter_dimension=scatter_dimension, tiled=True)


def all_gather(x, axis_name, *, axis=0, timeout_s=None):
    return lax.all_gather(x, axis_name, axis=axis, tiled=True)


def all_to_all(x, axis_name, split_axis, concat_axis, *, timeout_s=None):
    return lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)


def broadcast(x, axis_name, root=0, *, timeout_s=None):
    # lax has no one-to-all collective. A binomial tree of ppermutes (as MPI_Bcast does it):
    # in round d = 1, 2, 4, ... the members that already hold root's x (ranks below d, counted
    # from root) send it d ranks further. ceil(log2 n) rounds, O(|x|) memory, bitwise exact
    # (data is only moved and selected), and lax transposes it into the right gradient
    # (cotangents summed back up the tree onto root). Rejected: psum of x masked to root,
    # because XLA's sum starts from +0.0 and so turns root's -0.0 into +0.0 (found by the
    # conformance suite); all_gather + index, because it moves and holds n copies.
    n = lax.axis_size(axis_name)
    rank_from_root = (lax.axis_index(axis_name) - root) % n
    out, d = x, 1
    while d < n:
        perm = [((root + r) % n, (root + r + d) % n) for r in range(min(d, n - d))]
        received = _ppermute(out, axis_name, perm)
        out = jnp.where((rank_from_root >= d) & (rank_from_root < 2 * d), received, out)
        d *= 2
    return out


def _ppermute(x, axis_name, perm):
    """lax.ppermute with ranks row-major in the order of `axis_name`, as the API (and
    lax.axis_index) rank a group. Observed on jax 0.10.2: for a tuple of axes, ppermute numbers
    the members row-major in *mesh* order whatever the tuple's order, so a group ("c", "r") of a
    ("r", "c") mesh sent to the wrong members; jax 0.12 refuses such a tuple. Translate the pairs
    into mesh order and name the axes in mesh order."""
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    mesh_order = tuple(a for a in jax.sharding.get_abstract_mesh().axis_names if a in names)
    if len(names) > 1 and mesh_order != names:
        sizes = {a: lax.axis_size(a) for a in names}

        def in_mesh_order(rank):
            coords = dict(zip(names, np.unravel_index(rank, [sizes[a] for a in names])))
            return int(np.ravel_multi_index([coords[a] for a in mesh_order],
                                            [sizes[a] for a in mesh_order]))

        perm = [(in_mesh_order(s), in_mesh_order(d)) for s, d in perm]
        axis_name = mesh_order
    return lax.ppermute(x, axis_name, perm)


def permute(x, axis_name, perm, *, timeout_s=None):
    return _ppermute(x, axis_name, perm)
