"""The `ext` backend: the spec's collectives as the xla_ext FFI custom calls (CPU, one process).

Call these inside `jax.shard_map`; the semantics are those of the tiled lax collectives. Each
call passes the member's rank and group id as traced int32 scalars computed with
`lax.axis_index` (rank: row-major over the `axis_name` axes, like lax; group: row-major over
the other manual mesh axes), so a group can be a row or a column of a multi-axis mesh. The
group size, a call-site id (unique per trace) and the timeout are static attributes; the
handler (xla_ext/collectives.cc) keys its rendezvous by run id, call site, group and
invocation count. See docs/xla_ext.md for the design and the guarantees.

Gradients (custom_vjp), matching lax under `shard_map(..., check_vma=False)`: all_reduce(sum)
-> all_reduce(sum), mean -> mean, all_gather <-> reduce_scatter(sum), all_to_all -> all_to_all
with the axes swapped, permute -> inverse permute, broadcast -> sum onto root (zeros
elsewhere). max/min are not differentiable (neither are lax.pmax/pmin). vmap runs the
collective once per batch element (`vmap_method="sequential"`).
"""
from __future__ import annotations

import itertools
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spec_jax import xla_ext

DEFAULT_TIMEOUT_S = 120.0
"""How long a member waits for the others before the collective fails (seconds)."""

SUPPORTED_DTYPES = tuple(
    jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64, jnp.int32)
)
_REDUCE_OPS = {"sum": 0, "mean": 1, "max": 2, "min": 3}

_TARGETS = {
    name: f"trainspec_{name}"
    for name in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "permute")
}
assert set(_TARGETS.values()) <= xla_ext.TARGETS

# One id per traced call site; together with the run id it tells the handler which
# collectives of one execution belong together. itertools.count is atomic under the GIL.
_call_sites = itertools.count()


def live_rendezvous_count() -> int:
    """Rendezvous slots held by the handlers right now (0 when no collective is in flight)."""
    return xla_ext._xla_ext.live_rendezvous_count()


# ---- group coordinates ------------------------------------------------------------------------


def _group(op: str, axis_name):
    """(names, group size, rank, group id) of the calling member, checked at trace time."""
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(a for a in mesh.axis_names if a in mesh.manual_axes)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"{op}: axis_name must be a name or a tuple of distinct names, "
                         f"got {axis_name!r}")
    missing = [a for a in names if a not in manual]
    if missing:
        raise ValueError(f"{op}: axis {missing} is not a manual axis here; call it inside "
                         f"jax.shard_map over a mesh with axes {manual or '(none)'}")
    n = math.prod(mesh.shape[a] for a in names)
    rank = lax.axis_index(names).astype(jnp.int32)
    others = tuple(a for a in manual if a not in names)
    group = lax.axis_index(others).astype(jnp.int32) if others else jnp.int32(0)
    return names, n, rank, group


def _check_dtype(op: str, x) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{op}: dtype {x.dtype} is not supported by the ext backend "
                         f"(supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)})")


def _check_axis(op: str, x, axis: int, what: str) -> int:
    if not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{op}: {what}={axis!r} is out of range for an operand of shape "
                         f"{x.shape}")
    return int(axis) % x.ndim


def _check_divisible(op: str, x, axis: int, what: str, n: int, axis_name) -> None:
    if x.shape[axis] % n:
        raise ValueError(f"{op}: {what}={axis} has size {x.shape[axis]} in shape {x.shape}, "
                         f"not divisible by the group size {n} of axis {axis_name!r}")


def _timeout_ms(timeout_s) -> np.int64:
    t = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    if not t > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return np.int64(max(1, round(t * 1000)))


def _custom_call(op: str, x, out_shape, axis_name, timeout_s, **attrs):
    _, n, rank, group = _group(op, axis_name)
    call = jax.ffi.ffi_call(
        _TARGETS[op], jax.ShapeDtypeStruct(out_shape, x.dtype), vmap_method="sequential"
    )
    return call(x, rank, group, call_site=np.int64(next(_call_sites)), group_size=np.int64(n),
                timeout_ms=_timeout_ms(timeout_s), **attrs)


# ---- all_reduce -------------------------------------------------------------------------------


def all_reduce(x, axis_name, op="sum", *, timeout_s=None):
    """Like lax.psum / pmean / pmax / pmin (op "sum", "mean", "max", "min")."""
    x = jnp.asarray(x)
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce: op must be one of {tuple(_REDUCE_OPS)}, got {op!r}")
    _check_dtype("all_reduce", x)
    _timeout_ms(timeout_s)
    if op == "mean" and not jnp.issubdtype(x.dtype, jnp.inexact):
        # lax.pmean of an integer is psum / n, which promotes to float: do the same.
        return _all_reduce(x, axis_name, "sum", timeout_s) / _group("all_reduce", axis_name)[1]
    return _all_reduce(x, axis_name, op, timeout_s)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_reduce(x, axis_name, op, timeout_s):
    return _custom_call("all_reduce", x, x.shape, axis_name, timeout_s,
                        reduce_op=np.int64(_REDUCE_OPS[op]))


def _all_reduce_fwd(x, axis_name, op, timeout_s):
    return _all_reduce(x, axis_name, op, timeout_s), None


def _all_reduce_bwd(axis_name, op, timeout_s, _, ct):
    if op in ("max", "min"):
        raise ValueError(f"all_reduce with op={op!r} is not differentiable (nor is lax.p{op})")
    return (_all_reduce(ct, axis_name, op, timeout_s),)


_all_reduce.defvjp(_all_reduce_fwd, _all_reduce_bwd)


# ---- reduce_scatter / all_gather --------------------------------------------------------------


def reduce_scatter(x, axis_name, *, scatter_dimension=0, op="sum", timeout_s=None):
    """Like lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=True); op "sum"/"mean"."""
    x = jnp.asarray(x)
    if op not in ("sum", "mean"):
        raise ValueError(f"reduce_scatter: op must be 'sum' or 'mean', got {op!r}")
    _check_dtype("reduce_scatter", x)
    d = _check_axis("reduce_scatter", x, scatter_dimension, "scatter_dimension")
    n = _group("reduce_scatter", axis_name)[1]
    _check_divisible("reduce_scatter", x, d, "scatter_dimension", n, axis_name)
    _timeout_ms(timeout_s)
    if op == "mean" and not jnp.issubdtype(x.dtype, jnp.inexact):
        return _reduce_scatter(x, axis_name, d, "sum", timeout_s) / n
    return _reduce_scatter(x, axis_name, d, op, timeout_s)


def all_gather(x, axis_name, *, axis=0, timeout_s=None):
    """Like lax.all_gather(x, axis_name, axis=axis, tiled=True)."""
    x = jnp.asarray(x)
    _check_dtype("all_gather", x)
    a = _check_axis("all_gather", x, axis, "axis")
    _group("all_gather", axis_name)
    _timeout_ms(timeout_s)
    return _all_gather(x, axis_name, a, timeout_s)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _reduce_scatter(x, axis_name, d, op, timeout_s):
    n = _group("reduce_scatter", axis_name)[1]
    shape = x.shape[:d] + (x.shape[d] // n,) + x.shape[d + 1:]
    return _custom_call("reduce_scatter", x, shape, axis_name, timeout_s,
                        reduce_op=np.int64(_REDUCE_OPS[op]), scatter_dimension=np.int64(d))


def _reduce_scatter_fwd(x, axis_name, d, op, timeout_s):
    return _reduce_scatter(x, axis_name, d, op, timeout_s), None


def _reduce_scatter_bwd(axis_name, d, op, timeout_s, _, ct):
    g = _all_gather(ct, axis_name, d, timeout_s)
    return (g / _group("reduce_scatter", axis_name)[1] if op == "mean" else g,)


_reduce_scatter.defvjp(_reduce_scatter_fwd, _reduce_scatter_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_gather(x, axis_name, a, timeout_s):
    n = _group("all_gather", axis_name)[1]
    shape = x.shape[:a] + (x.shape[a] * n,) + x.shape[a + 1:]
    return _custom_call("all_gather", x, shape, axis_name, timeout_s, axis=np.int64(a))


def _all_gather_fwd(x, axis_name, a, timeout_s):
    return _all_gather(x, axis_name, a, timeout_s), None


def _all_gather_bwd(axis_name, a, timeout_s, _, ct):
    return (_reduce_scatter(ct, axis_name, a, "sum", timeout_s),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


# ---- all_to_all -------------------------------------------------------------------------------


def all_to_all(x, axis_name, split_axis, concat_axis, *, timeout_s=None):
    """Like lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)."""
    x = jnp.asarray(x)
    _check_dtype("all_to_all", x)
    s = _check_axis("all_to_all", x, split_axis, "split_axis")
    c = _check_axis("all_to_all", x, concat_axis, "concat_axis")
    n = _group("all_to_all", axis_name)[1]
    _check_divisible("all_to_all", x, s, "split_axis", n, axis_name)
    _timeout_ms(timeout_s)
    return _all_to_all(x, axis_name, s, c, timeout_s)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _all_to_all(x, axis_name, s, c, timeout_s):
    n = _group("all_to_all", axis_name)[1]
    shape = list(x.shape)
    shape[s] //= n
    shape[c] *= n
    return _custom_call("all_to_all", x, tuple(shape), axis_name, timeout_s,
                        split_axis=np.int64(s), concat_axis=np.int64(c))


def _all_to_all_fwd(x, axis_name, s, c, timeout_s):
    return _all_to_all(x, axis_name, s, c, timeout_s), None


def _all_to_all_bwd(axis_name, s, c, timeout_s, _, ct):
    return (_all_to_all(ct, axis_name, c, s, timeout_s),)


_all_to_all.defvjp(_all_to_all_fwd, _all_to_all_bwd)


# ---- broadcast / permute ----------------------------------------------------------------------


def broadcast(x, axis_name, root=0, *, timeout_s=None):
    """Every member gets member `root`'s x."""
    x = jnp.asarray(x)
    _check_dtype("broadcast", x)
    n = _group("broadcast", axis_name)[1]
    if not isinstance(root, (int, np.integer)) or not 0 <= root < n:
        raise ValueError(f"broadcast: root must be an int in [0, {n}), got {root!r}")
    _timeout_ms(timeout_s)
    return _broadcast(x, axis_name, int(root), timeout_s)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _broadcast(x, axis_name, root, timeout_s):
    return _custom_call("broadcast", x, x.shape, axis_name, timeout_s, root=np.int64(root))


def _broadcast_fwd(x, axis_name, root, timeout_s):
    return _broadcast(x, axis_name, root, timeout_s), None


def _broadcast_bwd(axis_name, root, timeout_s, _, ct):
    # Every member's output came from root's x: root's gradient is the sum of all cotangents.
    total = _all_reduce(ct, axis_name, "sum", timeout_s)
    rank = _group("broadcast", axis_name)[2]
    return (jnp.where(rank == root, total, jnp.zeros_like(total)),)


_broadcast.defvjp(_broadcast_fwd, _broadcast_bwd)


def permute(x, axis_name, perm, *, timeout_s=None):
    """Like lax.ppermute(x, axis_name, perm): perm is a list of (src, dst); ranks that nobody
    sends to get zeros."""
    x = jnp.asarray(x)
    _check_dtype("permute", x)
    n = _group("permute", axis_name)[1]
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError) as err:
        raise ValueError(f"permute: perm must be (src, dst) pairs of ints, got {perm!r}") from err
    for s, d in pairs:
        if not (0 <= s < n and 0 <= d < n):
            raise ValueError(f"permute: pair ({s}, {d}) has a rank outside [0, {n})")
    for side, ranks in (("sources", [s for s, _ in pairs]), ("destinations", [d for _, d in pairs])):
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"permute: {side} must be unique, got perm={pairs}")
    _timeout_ms(timeout_s)
    return _permute(x, axis_name, pairs, timeout_s)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _permute(x, axis_name, pairs, timeout_s):
    n = _group("permute", axis_name)[1]
    sources = np.full(n, -1, np.int64)  # indexed by destination
    for s, d in pairs:
        sources[d] = s
    return _custom_call("permute", x, x.shape, axis_name, timeout_s, sources=sources)


def _permute_fwd(x, axis_name, pairs, timeout_s):
    return _permute(x, axis_name, pairs, timeout_s), None


def _permute_bwd(axis_name, pairs, timeout_s, _, ct):
    return (_permute(ct, axis_name, tuple((d, s) for s, d in pairs), timeout_s),)


_permute.defvjp(_permute_fwd, _permute_bwd)
