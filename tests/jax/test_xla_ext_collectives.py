"""The xla_ext collective handlers (trainspec.jax.collectives.ext) on 8 simulated CPU devices.

Every op is checked against a NumPy reference and against the lax collective, over one mesh
axis and over rows/columns of a 2x4 mesh. The reductions are checked bit for bit against a
float32 sum in rank order (the handler's documented order), so determinism is a property of
the definition, not only of repeated runs. To keep the file fast, each (dtype, layout) is one
compiled program that runs all ops at once (see `_results`).
"""
import functools

import jax
import numpy as np
import pytest
from jax import lax

from ext_members import (DTYPES, MESH_1D, MESH_2D, member_inputs, on_every_member, per_member,
                         place, rank_order_sum)
from trainspec.jax.collectives import ext

# layout name -> (mesh, axis_name of the group, the groups as lists of member indices in rank
# order, where a member index is the flat position in the mesh).
LAYOUTS = {
    "1d": (MESH_1D, "d", [list(range(8))]),
    "rows": (MESH_2D, "y", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    "columns": (MESH_2D, "x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    "both_axes": (MESH_2D, ("x", "y"), [list(range(8))]),
}

# The op set as (ext call, lax call); every entry runs in one program per parametrisation.
def _ops(axis, n, floating):
    perm = [(i, i + 1) for i in range(n - 1)]  # rank 0 receives nothing -> zeros
    ops = {
        "all_reduce_sum": (lambda v: ext.all_reduce(v, axis), lambda v: lax.psum(v, axis)),
        "all_reduce_max": (lambda v: ext.all_reduce(v, axis, "max"), lambda v: lax.pmax(v, axis)),
        "all_reduce_min": (lambda v: ext.all_reduce(v, axis, "min"), lambda v: lax.pmin(v, axis)),
        "reduce_scatter_0": (lambda v: ext.reduce_scatter(v, axis),
                             lambda v: lax.psum_scatter(v, axis, tiled=True)),
        "reduce_scatter_1": (lambda v: ext.reduce_scatter(v, axis, scatter_dimension=1),
                             lambda v: lax.psum_scatter(v, axis, scatter_dimension=1, tiled=True)),
        "all_gather_0": (lambda v: ext.all_gather(v, axis),
                         lambda v: lax.all_gather(v, axis, tiled=True)),
        "all_gather_1": (lambda v: ext.all_gather(v, axis, axis=1),
                         lambda v: lax.all_gather(v, axis, axis=1, tiled=True)),
        "all_to_all_1_0": (lambda v: ext.all_to_all(v, axis, 1, 0),
                           lambda v: lax.all_to_all(v, axis, 1, 0, tiled=True)),
        "all_to_all_0_1": (lambda v: ext.all_to_all(v, axis, 0, 1),
                           lambda v: lax.all_to_all(v, axis, 0, 1, tiled=True)),
        "broadcast": (lambda v: ext.broadcast(v, axis, n - 1), None),
        "permute": (lambda v: ext.permute(v, axis, perm), lambda v: lax.ppermute(v, axis, perm)),
    }
    if floating:
        ops["all_reduce_mean"] = (lambda v: ext.all_reduce(v, axis, "mean"),
                                  lambda v: lax.pmean(v, axis))
    return ops


@functools.lru_cache(maxsize=None)
def _results(dtype_name, layout):
    """(inputs, ext outputs, lax outputs) per member for every op: two compiles in all."""
    dtype = DTYPES[dtype_name]
    mesh, axis, groups = LAYOUTS[layout]
    members = member_inputs(dtype)
    ops = _ops(axis, len(groups[0]), dtype != np.int32)
    x = place(members, mesh)
    got = per_member(on_every_member(
        lambda v: {k: e(v) for k, (e, _) in ops.items()}, mesh)(x), mesh)
    want = per_member(on_every_member(
        lambda v: {k: l(v) for k, (_, l) in ops.items() if l is not None}, mesh)(x), mesh)
    return members, got, want


# ---- NumPy references ---------------------------------------------------------------------------


def _reference(op, xs, rank):
    """Expected output of member `rank` of a group whose inputs are xs (rank order), float64."""
    n = len(xs)
    x64 = [v.astype(np.float64) for v in xs]
    if op == "all_reduce_sum":
        return sum(x64)
    if op == "all_reduce_mean":
        return sum(x64) / n
    if op == "all_reduce_max":
        return np.max(x64, axis=0)
    if op == "all_reduce_min":
        return np.min(x64, axis=0)
    if op.startswith("reduce_scatter_"):
        d = int(op[-1])
        return np.split(sum(x64), n, axis=d)[rank]
    if op.startswith("all_gather_"):
        return np.concatenate(x64, axis=int(op[-1]))
    if op.startswith("all_to_all_"):
        split, concat = int(op[-3]), int(op[-1])
        return np.concatenate([np.split(v, n, axis=split)[rank] for v in x64], axis=concat)
    if op == "broadcast":
        return x64[n - 1]
    if op == "permute":
        return np.zeros_like(x64[0]) if rank == 0 else x64[rank - 1]
    raise AssertionError(op)


EXACT_OPS = ("all_reduce_max", "all_reduce_min", "all_gather_0", "all_gather_1",
             "all_to_all_1_0", "all_to_all_0_1", "broadcast", "permute")
OP_NAMES = list(_ops("d", 8, True))


def _cases():
    for op in OP_NAMES:
        for dtype_name in DTYPES:
            if not (op == "all_reduce_mean" and dtype_name == "i32"):
                yield op, dtype_name, "1d"
        for layout in ("rows", "columns", "both_axes"):
            yield op, "f32", layout


@pytest.mark.parametrize("op,dtype_name,layout", list(_cases()))
def test_matches_numpy_reference(op, dtype_name, layout):
    members, got, _ = _results(dtype_name, layout)
    _, _, groups = LAYOUTS[layout]
    for group in groups:
        xs = [members[m] for m in group]
        for rank, m in enumerate(group):
            out = got[op][m]
            assert out.dtype == members.dtype
            expected = _reference(op, xs, rank)
            if op in EXACT_OPS or dtype_name == "i32":
                np.testing.assert_array_equal(out.astype(np.float64), expected)
            elif op in ("all_reduce_sum", "reduce_scatter_0", "reduce_scatter_1"):
                # Bit for bit the rank-order float32 sum, rounded once to the storage dtype.
                exact = rank_order_sum(xs)
                if op != "all_reduce_sum":
                    exact = np.split(exact, len(xs), axis=int(op[-1]))[rank]
                np.testing.assert_array_equal(out.view(np.uint8), exact.view(np.uint8))
                tol = 1e-2 if dtype_name == "bf16" else 1e-5
                np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tol,
                                           atol=tol * np.abs(xs).max())
            else:  # mean
                tol = 1e-2 if dtype_name == "bf16" else 1e-5
                np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tol,
                                           atol=tol * np.abs(xs).max())


@pytest.mark.parametrize("op,dtype_name,layout", [
    c for c in _cases() if c[0] != "broadcast"])
def test_matches_lax(op, dtype_name, layout):
    _, got, want = _results(dtype_name, layout)
    if op in EXACT_OPS or dtype_name == "i32":
        np.testing.assert_array_equal(got[op], want[op])
    else:
        # lax sums bf16 in its own order/precision; ext rounds a float32 sum once.
        tol = 2e-2 if dtype_name == "bf16" else 1e-5
        scale = np.abs(want[op].astype(np.float64)).max()
        np.testing.assert_allclose(got[op].astype(np.float64), want[op].astype(np.float64),
                                   rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_all_reduce_float16_and_float64(dtype):
    with jax.enable_x64(dtype == np.float64):
        members = member_inputs(dtype)
        f = on_every_member(lambda v: {"sum": ext.all_reduce(v, "d"),
                                  "max": ext.all_reduce(v, "d", "max")}, MESH_1D)
        got = per_member(f(place(members, MESH_1D)), MESH_1D)
    exact = rank_order_sum(list(members)) if dtype == np.float16 else None
    for m in range(8):
        assert got["sum"][m].dtype == dtype
        np.testing.assert_array_equal(got["max"][m], members.max(axis=0))
        if dtype == np.float16:  # accumulated in float32, rounded once
            np.testing.assert_array_equal(got["sum"][m], exact)
        else:
            acc = members[0].copy()
            for v in members[1:]:
                acc = acc + v
            np.testing.assert_array_equal(got["sum"][m], acc)
