"""Content checksums of a state's arrays, computed on device, the same on any mesh.

A checkpoint stores one checksum per array when it is saved, and a restore recomputes them on
the restored arrays: a flipped bit, overwritten bytes or a truncated file then make the restore
fail instead of training on from garbage.

Why not the replica fingerprints (trainspec.jax.fingerprint): those hash each device's shard, so
their values depend on the layout, and a restore may reshard onto another mesh. Here every
32-bit word of the array's C-order bytes is mixed with its position in the whole array and the
mixed words are summed modulo 2**32. Integer addition is exact and commutative, so XLA may split
the sum over shards and devices in any order and the result is the same bit for bit. Two
independent sums give 64 bits per array: a corruption passes unnoticed with probability ~2**-64.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}
_STREAMS = (np.uint32(0x9E3779B9), np.uint32(0x7F4A7C15))  # one odd multiplier per sum


def _mix(z):
    """murmur3's 32-bit finaliser: every input bit affects every output bit."""
    z = (z ^ (z >> 16)) * np.uint32(0x85EBCA6B)
    z = (z ^ (z >> 13)) * np.uint32(0xC2B2AE35)
    return z ^ (z >> 16)


def _words(x):
    """The array's bytes as uint32 words (8-byte elements: a trailing axis of 2 words)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)


def _leaf(x) -> jax.Array:
    words = _words(x)
    # Position of each word in C order, built from per-axis iotas: no reshape, which could
    # move data between the devices holding the shards.
    position = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        position = position + lax.broadcasted_iota(jnp.uint32, words.shape, axis) * np.uint32(stride % 2**32)
        stride *= words.shape[axis]
    sums = [jnp.sum(_mix(words ^ (position * k + k)), dtype=jnp.uint32) for k in _STREAMS]
    size = np.uint32(words.size % 2**32)  # so that trailing zero words still count
    return jnp.stack([_mix(s ^ size) for s in sums])


@functools.lru_cache(maxsize=None)
def _checksum_program(out_sharding):
    """One jitted program per output sharding, so every save and restore of a state of the same
    structure reuses its trace and compilation (a new lambda per call traced and compiled it
    again: ~1.2 s of CPU per checkpoint for the smallest model)."""
    return jax.jit(lambda xs: jnp.stack([_leaf(x) for x in xs]), out_shardings=out_sharding)


def checksums(state) -> dict[str, str]:
    """Checksum of each array of `state`, by its path, as 16 hex digits."""
    paths_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    leaves = [x for _, x in paths_leaves]
    mesh = next((x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding)), None)
    out = NamedSharding(mesh, P()) if mesh is not None else None  # readable on every process
    values = np.asarray(_checksum_program(out)(leaves))
    return {jax.tree_util.keystr(path): f"{int(hi):08x}{int(lo):08x}"
            for (path, _), (lo, hi) in zip(paths_leaves, values)}


def first_mismatch(saved: dict[str, str], state) -> str | None:
    """The path of the first array whose checksum differs from `saved` (or is missing)."""
    current = checksums(state)
    for path in sorted(set(saved) | set(current)):
        if saved.get(path) != current.get(path):
            return path
    return None
