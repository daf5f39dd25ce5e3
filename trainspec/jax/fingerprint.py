"""Per-shard fingerprints: a bit-exact, order-independent checksum of an array's bytes.

`fingerprint(x)` runs the xla_ext custom call on the device that holds `x` (under `shard_map`,
on each shard) and returns two uint32 words. `fingerprint_reference`
(trainspec/core/fingerprint.py) is the NumPy definition the handler must match bit for bit.
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from trainspec.core.fingerprint import fingerprint_reference  # noqa: F401 (the definition)

TARGET = "trainspec_fingerprint"
# Where the extension is built, load it now, so that handlers built for another jaxlib fail
# when a job starts, not at its first replica check. A source tree on PYTHONPATH where it could
# not be built (bench/device_check.sh) trains without it until a fingerprint is asked for.
if importlib.util.find_spec("trainspec.jax._xla_ext") is not None:
    from trainspec.jax import xla_ext  # noqa: F401


def fingerprint(x: jax.Array) -> jax.Array:
    """uint32[2] (low word, high word) fingerprint of `x`'s bytes, computed on its device."""
    from trainspec.jax import xla_ext

    assert TARGET in xla_ext.TARGETS
    x = jnp.asarray(x)
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((2,), jnp.uint32), vmap_method="sequential"
    )
    return call(x)
