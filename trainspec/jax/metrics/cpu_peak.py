"""This machine's CPU matmul peak measured with jax: float32 square matmuls on one jax device
(the process's whole thread pool). The cache, its key and the modes are trainspec.core.cpu_peak's,
shared with the torch implementation, so both divide MFU by the same peak."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from trainspec.core import cpu_peak as core
from trainspec.core.cpu_peak import cache_file, machine_key, store  # noqa: F401  (bench/)
from trainspec.core.flops import Peak


def matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    """Best float32 matmul FLOP/s of the process on one device, over `repeats` calls."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    return core.best_rate(lambda: f(a, a).block_until_ready(), n, repeats)


def measure(sizes=core.SIZES, repeats: int = 5) -> dict:
    """One cache entry: the peak and the conditions it was measured under."""
    return core.entry({n: matmul_peak(n, repeats) for n in sizes}, f"jax {jax.__version__}")


def process_peak() -> Peak | None:
    """The machine's peak (trainspec.core.cpu_peak.process_peak); on a miss measured here,
    unless this is one process of several."""
    return core.process_peak(measure if jax.process_count() == 1 else None)
