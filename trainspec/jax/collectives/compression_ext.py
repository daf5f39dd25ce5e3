"""Compressed gradient reduction on the `ext` backend: the xla_ext packed-buffer handlers.

Same contract as trainspec.jax.collectives.compression.compressed_sum (the jnp kernels of the `xla`
backend), bit for bit, and the same two-stage exchange: the error-feedback handler packs each
chunk of `flat + residual` into one contiguous buffer (header, per-block scales, payload;
trainspec.core.packed) and keeps what the packing lost as the residual; the ext all-to-all and
all-gather move the packed buffers as int32 words; the dequantize handler unpacks them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trainspec.jax import xla_ext
from trainspec.jax.collectives import ext
from trainspec.jax.collectives.compression import Exchange, two_stage_sum
from trainspec.core.compression import chunk_size
from trainspec.core.packed import MAGIC, packed_bytes

MAGIC_WORD = np.int32(MAGIC)  # the first int32 word of every packed buffer
TARGETS = {op: f"trainspec_{op}" for op in ("quantize", "dequantize", "error_feedback")}
assert set(TARGETS.values()) <= xla_ext.TARGETS


def _attrs(compression: str, block: int) -> dict:
    return {"compression": compression, "block": np.int64(block if compression == "int8" else 0)}


def _packed(x, compression: str, block: int, dtype=jnp.uint8) -> jax.ShapeDtypeStruct:
    """One packed buffer, as bytes or as int32 words (its size is a multiple of 4)."""
    size = packed_bytes(x.size, compression, block) // jnp.dtype(dtype).itemsize
    return jax.ShapeDtypeStruct((size,), dtype)


def quantize(x: jax.Array, compression: str, block: int) -> jax.Array:
    """The packed buffer (uint8) of the float32 values `x`."""
    call = jax.ffi.ffi_call(TARGETS["quantize"], _packed(x, compression, block),
                            vmap_method="sequential")
    return call(x, **_attrs(compression, block))


def dequantize_sum(packed: jax.Array, compression: str, block: int, size: int) -> jax.Array:
    """float32[size]: the sum of the packed buffers `packed` ((k, bytes) uint8 or (k, words)
    int32) in order."""
    call = jax.ffi.ffi_call(TARGETS["dequantize"], jax.ShapeDtypeStruct((size,), jnp.float32),
                            vmap_method="sequential")
    return call(packed, **_attrs(compression, block))


def error_feedback(g: jax.Array, residual: jax.Array, compression: str, block: int,
                   dtype=jnp.uint8) -> tuple[jax.Array, jax.Array]:
    """(packed buffer of g + residual, as bytes or int32 words (`dtype`); (g + residual) -
    what the packed buffer carries)."""
    call = jax.ffi.ffi_call(
        TARGETS["error_feedback"],
        (_packed(g, compression, block, dtype), jax.ShapeDtypeStruct(g.shape, jnp.float32)),
        vmap_method="sequential")
    return call(g, residual, **_attrs(compression, block))


def feedback_round_trip(x: jax.Array, residual: jax.Array, compression: str,
                        block: int) -> tuple[jax.Array, jax.Array]:
    """compression.feedback_round_trip by the handlers: packed, then unpacked."""
    packed, new_residual = error_feedback(x, residual, compression, block)
    return dequantize_sum(packed[None], compression, block, x.size), new_residual


def compressed_sum(flat: jax.Array, residual: jax.Array | None, group, replicas: int,
                   compression: str, block: int,
                   timeout_s: float | None = None) -> tuple[jax.Array, jax.Array | None]:
    """The two-stage exchange (trainspec.jax.collectives.compression.two_stage_sum) with a packed
    buffer per chunk: the error-feedback handler packs each chunk and keeps what packing lost,
    the dequantize handler unpacks, and the ext all-to-all and all-gather move the buffers.
    int32 words end to end: ext's collectives move them, and no bitcast copies the buffers."""
    chunk = chunk_size(flat.size, replicas, compression, block)
    gathered = []  # the all-gather's result, traced once

    def all_gather(words):
        gathered.append(ext.all_gather(words, group, axis=0, timeout_s=timeout_s))
        return gathered[-1]

    exchange = Exchange(
        jax.vmap(lambda rows, res: error_feedback(rows, res, compression, block, jnp.int32)),
        jax.vmap(lambda words: dequantize_sum(words[None], compression, block, chunk)),
        lambda words: ext.all_to_all(words, group, 0, 0, timeout_s=timeout_s), all_gather)
    total, new_residual = two_stage_sum(flat, residual, group, replicas, chunk, exchange)
    if new_residual is not None:
        # Released only once the last blocking all-gather has delivered (its first word is a
        # header's magic, so the select always keeps the residual): the residual is state, and
        # an XLA collective over the state (the NaN guard's all-reduce) running beside a
        # blocking ext collective deadlocks on CPU (docs/xla_ext.md, "Ordering").
        new_residual = jnp.where(gathered[0][0, 0] == MAGIC_WORD, new_residual, jnp.nan)
    return total, new_residual
