"""Is this machine fit to train? Per-device numerics, collective conformance and links.

Numerics (per device, one program over all devices): float32, bfloat16 and float16 sums and
means over long and odd lengths (and along the last axis of odd 2-D shapes), through jnp and an
explicit XLA reduce; a matmul. Each result is held
against the exact float64 reference and the error bound of its algorithm (trainspec.core.numerics):
XLA's reductions are trees (pairwise bound, float32 accumulation). The collectives backends'
all_reduce is checked the same way by trainspec.jax.collectives.selftest (`trainspec doctor`).

A planted fault (`Fault`) replaces one device's reduction with a kernel that drops the last
partial block of `block` elements, the shape-dependent kind of bug a tolerance-free check
misses; tests/cli/test_doctor.py shows the self-test names it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainspec.core import numerics

AXIS = "dev"
DTYPES = numerics.DTYPES
LENGTHS = (1, 7, 127, 129, 4099, 65537, 1000003)  # odd, and straddling power-of-two blocks
SHAPES_2D = ((17, 257), (3, 4099))                 # reduced along the last axis
MATMUL = ((127, 255), (255, 129))


@dataclasses.dataclass(frozen=True)
class Fault:
    """Device `device` (an id) sums only whole blocks of `block` elements (drops the rest)."""

    device: int
    block: int = 128


def _reductions(fault_position: int | None, block: int):
    """name -> f(x) reducing the last axis, as run on the device at mesh position `i`."""

    def faulty(reduce):
        def run(x):
            n = x.shape[-1]
            if fault_position is None or n % block == 0 or n < block:
                return reduce(x)
            dropped = reduce(x[..., : n - n % block])
            return jnp.where(lax.axis_index(AXIS) == fault_position, dropped, reduce(x))
        return run

    def xla_reduce(x):
        return lax.reduce(x.astype(jnp.float32), np.float32(0), lax.add, (x.ndim - 1,)).astype(x.dtype)

    return {
        "jnp.sum": faulty(lambda x: jnp.sum(x, axis=-1)),
        "lax.reduce": faulty(xla_reduce),
        "jnp.mean": faulty(lambda x: jnp.mean(x, axis=-1)),
    }


@functools.lru_cache(maxsize=None)
def _mesh(device_ids: tuple[int, ...]) -> Mesh:
    by_id = {d.id: d for d in jax.devices()}
    return Mesh(np.array([by_id[i] for i in device_ids]), (AXIS,))


def _per_device(fn, mesh: Mesh, x: np.ndarray, dtype: str):
    """fn applied on every device to the same x: results stacked along a leading device axis."""
    arr = jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, P()))
    body = lambda a: jax.tree.map(lambda r: r[None], fn(a))  # noqa: E731
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(AXIS), check_vma=False))(arr)
    return jax.tree.map(lambda r: np.asarray(r.astype(jnp.float32), np.float64), out)


def reduction_results(device_ids, fault: Fault | None = None) -> list[numerics.Result]:
    mesh = _mesh(tuple(device_ids))
    position = list(device_ids).index(fault.device) if fault and fault.device in device_ids else None
    kernels = _reductions(position, fault.block if fault else 128)
    results = []
    shapes = [(n,) for n in LENGTHS] + list(SHAPES_2D)
    for dtype in DTYPES:
        for i, shape in enumerate(shapes):
            x = numerics.selftest_inputs(shape, dtype, seed=i)
            got = _per_device(lambda a: {k: f(a) for k, f in kernels.items()}, mesh, x, dtype)
            n = shape[-1]
            rows = x.reshape(-1, n)
            exact = np.array([numerics.reference_sum(r) for r in rows])
            bound = np.array([numerics.sum_error_bound(r, "pairwise", "float32", dtype) for r in rows])
            for name, values in got.items():
                values = values.reshape(len(device_ids), -1)
                ref, lim = (exact / n, bound / n + numerics.EPS[dtype] / 2 * np.abs(exact / n)) \
                    if name == "jnp.mean" else (exact, bound)
                for dev, row in zip(device_ids, values):
                    ratio = np.abs(row - ref) / lim
                    worst = int(np.argmax(ratio))
                    results.append(numerics.Result(
                        f"{name} {dtype} shape={shape}", dev, float(abs(row[worst] - ref[worst])),
                        float(lim[worst])))
    return results


def matmul_results(device_ids) -> list[numerics.Result]:
    mesh = _mesh(tuple(device_ids))
    results = []
    for dtype in DTYPES:
        a, b = numerics.selftest_inputs(MATMUL[0], dtype, 11), numerics.selftest_inputs(MATMUL[1], dtype, 12)
        bound = numerics.matmul_error_bound(a, b, "float32", dtype)
        ref = a @ b
        bd = jax.device_put(jnp.asarray(b, dtype), NamedSharding(mesh, P()))
        got = _per_device(lambda x: jnp.matmul(x, bd), mesh, a, dtype)
        for dev, c in zip(device_ids, got):
            ratio = np.abs(c - ref) / bound
            worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
            results.append(numerics.Result(f"matmul {dtype} {MATMUL[0]}x{MATMUL[1]}", dev,
                                           float(abs(c[worst] - ref[worst])), float(bound[worst])))
    return results


def failing_devices(results: list[numerics.Result]) -> dict[int, list[str]]:
    """Device id -> names of the checks it failed."""
    out: dict[int, list[str]] = {}
    for r in results:
        if not r.ok and r.device is not None:
            out.setdefault(r.device, []).append(r.check)
    return out


def quick_device_checks(device_ids=None, fault: Fault | None = None) -> list[numerics.Result]:
    """What `health.preflight` runs: the per-device reductions and matmul (no collectives)."""
    ids = [d.id for d in jax.local_devices()] if device_ids is None else list(device_ids)
    return reduction_results(ids, fault) + matmul_results(ids)
