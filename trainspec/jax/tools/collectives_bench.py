"""Collective benchmarks in the manner of nccl-tests, for any backend of trainspec.jax.collectives.

Definitions (nccl-tests doc/PERFORMANCE.md):
  size S     bytes per device of the larger buffer of the op: the input of all_reduce,
             all_to_all, broadcast and permute (input and output are both S), the input of
             reduce_scatter (output S/n), the output of all_gather (input S/n). count = S / itemsize,
             rounded down to a multiple of the group size n so every op is legal.
  time       median over `iters` calls, each waited for (block_until_ready), after `warmup`
             calls. nccl-tests averages back-to-back launches; the median is used here because
             the benchmark machines are shared and one descheduled call would skew a mean.
             The backends' calls alternate, so both see the same background load.
  algbw      S / time, in GB/s with GB = 1e9 bytes.
  busbw      algbw x factor, the bandwidth a link would need under the optimal algorithm:
             all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all (n-1)/n; broadcast and
             permute 1.
  #wrong     result elements that differ from the exact expected value. Inputs are small
             integers ((i + 3 r) mod 13 - 6 for element i on rank r), so every sum of them is
             exact in every dtype and the tolerance is 0 ULP, except mean, which allows 1 ULP
             (division by a group size that is not a power of two rounds).
  in place   (`in_place=True`, all_reduce only) nccl-tests' in-place form, recvbuff == sendbuff:
             before each call, untimed, the input is copied into a fresh buffer, which the call
             is given (donated) and which holds the result after it (api.all_reduce's in_place;
             XLA's own all-reduce writes a new buffer and copies it back into the donated one).
The group is a 1-D mesh over all devices; permute is the cyclic shift r -> r+1 (nccl-tests'
sendrecv); broadcast uses root 0. Under `trainspec launch` (several processes) the mesh is
(process, device): xla and hierarchical are measured over all devices of all processes, ext,
whose rendezvous is in-process, over the devices of each process (`group_size` in the rows).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainspec.jax import backends, collectives
from trainspec.core.errors import UserInputError
from trainspec.jax.metrics.comm import bus_factor

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "permute")
DTYPES = ("float32", "bfloat16", "float16", "float64", "int32")
REDOPS = {"all_reduce": ("sum", "mean", "max", "min"), "reduce_scatter": ("sum", "mean")}
AXIS = "d"


# ---- sizes --------------------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str, what: str) -> int:
    """'4K' -> 4096, '64M', '1G', '512' (binary units, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGB]?)B?\s*", str(text),
                     re.IGNORECASE | re.ASCII)  # \d alone takes any script's digits
    if not m or int(m.group(1)) == 0:
        raise UserInputError(f"{what}: expected a positive size like 4K, 64M or 1G, got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if min_bytes > max_bytes:
        raise UserInputError(f"-b/--min-bytes ({min_bytes}) exceeds -e/--max-bytes ({max_bytes})")
    if factor < 2 and min_bytes != max_bytes:
        raise UserInputError(f"-f/--step-factor must be at least 2, got {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


# ---- one measurement ----------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    op: str
    dtype: str
    redop: str  # "none" for ops without a reduction, as nccl-tests prints it
    size_bytes: int
    count: int
    backend: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int
    group_size: int | None = None  # set across processes, where ext's group is one process
    in_place: bool = False

    @property
    def root(self) -> int:
        return 0 if self.op == "broadcast" else -1

    @property
    def variant(self) -> str:
        """The backend as the table names it: "ext", or "ext in-place"."""
        return variant_name(self.backend, self.in_place)


def variant_name(backend: str, in_place: bool) -> str:
    return f"{backend} in-place" if in_place else backend


def variants(backends, in_place: bool) -> list[tuple[str, bool]]:
    """(backend, in place) of every measured form: each backend out of place, and with
    `in_place` in place too."""
    return [(b, p) for b in backends for p in ((False, True) if in_place else (False,))]


def _value(i, rank, dtype):
    """Input element i of `rank`: small integers, so sums are exact in every dtype."""
    return ((i + 3 * rank) % 13 - 6).astype(dtype)


def _call(op: str, redop: str, backend: str, n: int, group=AXIS, in_place=False):
    """The op under test on a member's 1-D operand."""
    kwargs = {"backend": backend}
    if in_place:
        kwargs["in_place"] = True
    if op in REDOPS:
        kwargs["op"] = redop
    if op == "permute":
        kwargs["perm"] = [(r, (r + 1) % n) for r in range(n)]
    if op == "all_to_all":
        return lambda x: collectives.all_to_all(x, group, 0, 0, **kwargs)
    return lambda x: getattr(collectives, op)(x, group, **kwargs)


def _expected(op: str, redop: str, count: int, rank, n: int, dtype):
    """What member `rank` must hold, computed from the input formula (in int32, then cast)."""
    block = count // n
    if op == "all_gather":  # element i comes from member i // block, its element i % block
        i = jnp.arange(count)
        return _value(i % block, i // block, dtype)
    if op == "all_to_all":  # block j comes from member j: its block `rank`
        i = jnp.arange(count)
        return _value(rank * block + i % block, i // block, dtype)
    if op == "broadcast":
        return _value(jnp.arange(count), 0, dtype)
    if op == "permute":
        return _value(jnp.arange(count), (rank - 1) % n, dtype)
    i = jnp.arange(count) if op == "all_reduce" else rank * block + jnp.arange(block)
    # A chain of elementwise ops, which XLA fuses: no (n, count) array is materialised.
    combine = {"max": jnp.maximum, "min": jnp.minimum}.get(redop, jnp.add)
    total = _value(i, 0, jnp.int32)
    for r in range(1, n):
        total = combine(total, _value(i, r, jnp.int32))
    return (total / n).astype(dtype) if redop == "mean" else total.astype(dtype)


def _mismatches(out, want, redop):
    if redop != "mean":
        return jnp.sum(out != want)
    ulp = jnp.abs(jnp.nextafter(want, jnp.array(jnp.inf, want.dtype)) - want)
    return jnp.sum(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))
                   > ulp.astype(jnp.float32))


PROCESS_AXIS = "p"


def _mesh() -> Mesh:
    """One process: a 1-D mesh over its devices. Several (under `trainspec launch`): a
    (process, device) mesh, jax.devices() listing each process's devices together."""
    if jax.process_count() == 1:
        return Mesh(np.array(jax.devices()), (AXIS,))
    return Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), (PROCESS_AXIS, AXIS))


def group_of(backend: str, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a backend is measured over: all of them, except that `ext` (an in-process
    rendezvous) spans only the devices of one process when there are several."""
    if backends.backend(backend).in_process_only and PROCESS_AXIS in mesh.axis_names:
        return (AXIS,)
    return tuple(mesh.axis_names)


def _host(result) -> np.ndarray:
    """Every process fetches the whole result (it spans all processes' devices)."""
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(result, tiled=True))
    return np.asarray(result)


def measure(op: str, dtype: str, redop: str, size_bytes: int, backends,
            iters: int = 20, warmup: int = 5, in_place: bool = False) -> list[Row]:
    """Benchmark one (op, dtype, redop, size) on all devices for each backend; see the module
    doc. The backends' timed calls alternate (xla, ext, xla, ext, ...) so that load from other
    processes on a shared machine falls on both alike and their ratio stays fair. With
    `in_place` (all_reduce only) each backend is then measured in place, alternating again."""
    backends = [backends] if isinstance(backends, str) else list(backends)
    if in_place and op != "all_reduce":
        raise UserInputError(f"--in-place: only all_reduce has an in-place form, not {op}")
    forms = variants(backends, in_place)
    mesh = _mesh()
    spec = P(tuple(mesh.axis_names))  # one device per member, row-major over the mesh
    groups = {b: group_of(b, mesh) for b in backends}
    sizes = {b: math.prod(mesh.shape[a] for a in groups[b]) for b in backends}
    itemsize = jnp.dtype(dtype).itemsize
    n_max = max(sizes.values())  # a multiple of every group size (groups nest)
    count = max(n_max, size_bytes // itemsize // n_max * n_max)
    shard = lambda f, donate=(): jax.jit(jax.shard_map(  # noqa: E731
        f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False), donate_argnums=donate)

    with contextlib.ExitStack() as scope:
        if dtype == "float64":
            scope.enter_context(jax.enable_x64(True))
        scope.enter_context(jax.set_mesh(mesh))  # hierarchical reads the processes off it
        # A member's rank in its group: the group is the whole mesh or its minor axis.
        ranks = {b: jax.device_put(np.arange(mesh.size, dtype=np.int32) % sizes[b],
                                   NamedSharding(mesh, spec)) for b in backends}
        xs = {b: shard(lambda r, n=sizes[b]: _value(
            jnp.arange(count // n if op == "all_gather" else count), r[0], dtype))(ranks[b])
            for b in backends}
        runs = {(b, p): shard(_call(op, redop, b, sizes[b], groups[b], p), (0,) if p else ())
                for b, p in forms}
        fresh = jax.jit(jnp.copy)  # an in-place call's own input buffer, made before the clock

        def call(form):
            backend, placed = form
            x = fresh(xs[backend]).block_until_ready() if placed else xs[backend]
            start = time.perf_counter()
            out = runs[form](x).block_until_ready()
            return out, time.perf_counter() - start

        # Out of place, then in place, each placement's backends alternating: alternated with
        # in-place calls (a fresh copy each), out-of-place calls of 64 MiB fault their outputs
        # in 4 KiB pages and take several times longer (docs/results.md, set M9).
        outs, times = {}, {form: [] for form in forms}
        for placed in dict.fromkeys(p for _, p in forms):
            alike = [form for form in forms if form[1] == placed]
            for v in alike:
                for _ in range(warmup):
                    outs[v] = call(v)[0]
            for _ in range(iters):
                for v in alike:
                    outs[v], seconds = call(v)
                    times[v].append(seconds)
        wrong = {}
        for (b, p), out in outs.items():
            check = shard(lambda o, r, n=sizes[b]: _mismatches(
                o, _expected(op, redop, count, r[0], n, dtype), redop)[None])
            wrong[b, p] = int(np.sum(_host(check(out, ranks[b]))))

    size = count * itemsize
    rows = []
    for b, p in forms:
        seconds = statistics.median(times[b, p])
        algbw = size / seconds / 1e9
        rows.append(Row(op, dtype, redop if op in REDOPS else "none", size, count, b,
                        seconds * 1e6, algbw, algbw * bus_factor(op, sizes[b]), wrong[b, p],
                        sizes[b] if jax.process_count() > 1 else None, p))
    return rows


def sweep(ops, dtypes, backends, sizes, redop="sum", iters=20, warmup=5, progress=None,
          in_place=False):
    """Rows for every (op, dtype, size) x backend, the backends measured side by side (and,
    with `in_place`, each in place too). An op without `redop` (reduce_scatter has no
    max/min) is measured with sum; mean of int32, which the API rejects, is left out."""
    rows = []
    for op in ops:
        op_redop = redop if redop in REDOPS.get(op, ()) else "sum"
        for dtype in dtypes:
            if op_redop == "mean" and dtype == "int32":
                continue  # the API rejects the mean of integers
            for size in sizes:
                for row in measure(op, dtype, op_redop, size, backends, iters, warmup,
                                   in_place):
                    rows.append(row)
                    if progress:
                        progress(row)
    return rows
