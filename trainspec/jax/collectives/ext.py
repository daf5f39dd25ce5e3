"""The `ext` backend: the spec's collectives as the xla_ext FFI custom calls.

On CPU the handlers meet in process (xla_ext/collectives.cc). On a GPU mesh the same targets
run the CUDA handlers (xla_ext/cuda/nccl_handlers.cc) over an NCCL communicator per group
(trainspec.jax.collectives.nccl, made when the call is traced under `jax.set_mesh`); there,
all_reduce is deterministic (rank-order sums, the CPU handlers' results) unless
`deterministic=False` asks for one ncclAllReduce, and gathered, scattered or split dimensions
must be the leading one.

Call these through `trainspec.jax.collectives` (api.py validates the arguments; this module trusts
them) inside `jax.shard_map`; the semantics are those of the tiled lax collectives. Each
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

from jax._src.mesh import get_concrete_mesh  # no public accessor in jax 0.10.2

from trainspec.jax import xla_ext
from trainspec.jax.collectives import nccl
from trainspec.core.spec import DEFAULT_COLLECTIVE_TIMEOUT_S

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


def _group(axis_name):
    """(group size, rank, group id) of the calling member (the API checked the names)."""
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    mesh = jax.sharding.get_abstract_mesh()
    n = math.prod(mesh.shape[a] for a in names)
    rank = lax.axis_index(names).astype(jnp.int32)
    others = tuple(a for a in mesh.axis_names if a in mesh.manual_axes and a not in names)
    group = lax.axis_index(others).astype(jnp.int32) if others else jnp.int32(0)
    return n, rank, group


def _timeout_ms(timeout_s) -> np.int64:
    t = DEFAULT_COLLECTIVE_TIMEOUT_S if timeout_s is None else timeout_s
    return np.int64(max(1, round(t * 1000)))


def _gpu_attrs(op: str, names: tuple[str, ...], timeout_s, gpu_only: dict) -> dict:
    """The CUDA handlers' extra attributes on a GPU mesh: the group's NCCL communicator and the
    op's `gpu_only` ones; none on CPU. Refuses in one line what cannot run on this GPU."""
    mesh = get_concrete_mesh()
    concrete = mesh is not None and not mesh.empty
    platform = mesh.devices.flat[0].platform if concrete else jax.default_backend()
    if platform != "gpu":
        return {}
    xla_ext.require_cuda(_TARGETS[op])
    if not concrete:
        raise ValueError(f"ext {op} on a GPU needs the concrete mesh to make its NCCL "
                         "communicator: trace under `with jax.set_mesh(mesh):`")
    t = DEFAULT_COLLECTIVE_TIMEOUT_S if timeout_s is None else timeout_s
    return {"comm": np.int64(nccl.communicator(mesh, names, t)),
            **{k: np.int64(v) for k, v in gpu_only.items()}}


def _custom_call(op: str, x, out_shape, axis_name, timeout_s, in_place=False, gpu_only=None,
                 **attrs):
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    attrs.update(_gpu_attrs(op, names, timeout_s, gpu_only or {}))
    n, rank, group = _group(axis_name)
    # In place, the output takes the input's buffer (operand 0): the handler's units read every
    # member's elements of a range before writing that range anywhere, so reading and writing
    # one buffer is safe (xla_ext/collective_policies.h). Where `x` is used again, XLA's copy
    # insertion gives the call a copy.
    call = jax.ffi.ffi_call(
        _TARGETS[op], jax.ShapeDtypeStruct(out_shape, x.dtype), vmap_method="sequential",
        input_output_aliases={0: 0} if in_place else None,
    )
    # The HLO keeps the group size (an attribute) but not which mesh axes form the group: the
    # name scope carries them into the call's metadata for trainspec.jax.metrics.comm to read.
    with jax.named_scope("trainspec_axes=" + "+".join(names)):
        return call(x, rank, group, call_site=np.int64(next(_call_sites)), group_size=np.int64(n),
                    timeout_ms=_timeout_ms(timeout_s), **attrs)


# ---- all_reduce -------------------------------------------------------------------------------


def all_reduce(x, axis_name, op="sum", *, timeout_s=None, in_place=False, deterministic=True):
    """Like lax.psum / pmean / pmax / pmin (op "sum", "mean", "max", "min"); `in_place`: the
    result is written over `x`'s buffer (its gradient's too). `deterministic=False` lets a GPU
    run one ncclAllReduce (NCCL's reduction order); the CPU handlers are always deterministic."""
    return _all_reduce(x, axis_name, op, timeout_s, in_place, deterministic)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _all_reduce(x, axis_name, op, timeout_s, in_place, deterministic):
    return _custom_call("all_reduce", x, x.shape, axis_name, timeout_s, in_place,
                        gpu_only={"deterministic": deterministic},
                        reduce_op=np.int64(_REDUCE_OPS[op]))


def _all_reduce_fwd(x, axis_name, op, timeout_s, in_place, deterministic):
    return _all_reduce(x, axis_name, op, timeout_s, in_place, deterministic), None


def _all_reduce_bwd(axis_name, op, timeout_s, in_place, deterministic, _, ct):
    if op in ("max", "min"):
        raise ValueError(f"all_reduce with op={op!r} is not differentiable (nor is lax.p{op})")
    return (_all_reduce(ct, axis_name, op, timeout_s, in_place, deterministic),)


_all_reduce.defvjp(_all_reduce_fwd, _all_reduce_bwd)


# ---- reduce_scatter / all_gather --------------------------------------------------------------


def reduce_scatter(x, axis_name, *, scatter_dimension=0, op="sum", timeout_s=None):
    """Like lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=True); op "sum"/"mean"."""
    return _reduce_scatter(x, axis_name, scatter_dimension, op, timeout_s)


def all_gather(x, axis_name, *, axis=0, timeout_s=None):
    """Like lax.all_gather(x, axis_name, axis=axis, tiled=True)."""
    return _all_gather(x, axis_name, axis, timeout_s)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _reduce_scatter(x, axis_name, d, op, timeout_s):
    n = _group(axis_name)[0]
    shape = x.shape[:d] + (x.shape[d] // n,) + x.shape[d + 1:]
    return _custom_call("reduce_scatter", x, shape, axis_name, timeout_s,
                        reduce_op=np.int64(_REDUCE_OPS[op]), scatter_dimension=np.int64(d))


def _reduce_scatter_fwd(x, axis_name, d, op, timeout_s):
    return _reduce_scatter(x, axis_name, d, op, timeout_s), None


def _reduce_scatter_bwd(axis_name, d, op, timeout_s, _, ct):
    g = _all_gather(ct, axis_name, d, timeout_s)
    return (g / _group(axis_name)[0] if op == "mean" else g,)


_reduce_scatter.defvjp(_reduce_scatter_fwd, _reduce_scatter_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_gather(x, axis_name, a, timeout_s):
    n = _group(axis_name)[0]
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
    return _all_to_all(x, axis_name, split_axis, concat_axis, timeout_s)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _all_to_all(x, axis_name, s, c, timeout_s):
    n = _group(axis_name)[0]
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
    return _broadcast(x, axis_name, root, timeout_s)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _broadcast(x, axis_name, root, timeout_s):
    return _custom_call("broadcast", x, x.shape, axis_name, timeout_s, root=np.int64(root))


def _broadcast_fwd(x, axis_name, root, timeout_s):
    return _broadcast(x, axis_name, root, timeout_s), None


def _broadcast_bwd(axis_name, root, timeout_s, _, ct):
    # Every member's output came from root's x: root's gradient is the sum of all cotangents.
    total = _all_reduce(ct, axis_name, "sum", timeout_s, False, True)
    rank = _group(axis_name)[1]
    return (jnp.where(rank == root, total, jnp.zeros_like(total)),)


_broadcast.defvjp(_broadcast_fwd, _broadcast_bwd)


def permute(x, axis_name, perm, *, timeout_s=None):
    """Like lax.ppermute(x, axis_name, perm): perm is a list of (src, dst); ranks that nobody
    sends to get zeros."""
    return _permute(x, axis_name, perm, timeout_s)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _permute(x, axis_name, pairs, timeout_s):
    n = _group(axis_name)[0]
    sources = np.full(n, -1, np.int64)  # indexed by destination
    for s, d in pairs:
        sources[d] = s
    return _custom_call("permute", x, x.shape, axis_name, timeout_s, sources=sources)


def _permute_fwd(x, axis_name, pairs, timeout_s):
    return _permute(x, axis_name, pairs, timeout_s), None


def _permute_bwd(axis_name, pairs, timeout_s, _, ct):
    return (_permute(ct, axis_name, tuple((d, s) for s, d in pairs), timeout_s),)


_permute.defvjp(_permute_fwd, _permute_bwd)
