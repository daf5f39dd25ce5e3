"""Compressed gradient reduction on the `ext` backend: the xla_ext packed-buffer handlers.

Same contract as spec_jax.collectives.compression.compressed_sum (the jnp kernels of the `xla`
backend), bit for bit: each replica's error-feedback handler packs `flat + residual` into one
contiguous buffer (header, per-block scales, payload; spec_jax.core.packed) and keeps what the
packing lost as its new residual; the ext all-gather moves the packed buffers as int32 words;
the dequantize handler unpacks them and sums them in rank order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import xla_ext
from spec_jax.collectives import ext
from spec_jax.core.packed import packed_bytes

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


def compressed_sum(flat: jax.Array, residual: jax.Array, group, compression: str, block: int,
                   timeout_s: float | None = None) -> tuple[jax.Array, jax.Array]:
    """(sum over `group` of every replica's compressed `flat + residual`, this replica's new
    residual). Inside a shard_map over the data axes `group`."""
    # int32 words end to end: ext's all-gather moves them, and no bitcast copies the buffers
    words, new_residual = error_feedback(flat.astype(jnp.float32), residual, compression, block,
                                         jnp.int32)
    gathered = ext.all_gather(words[None], group, axis=0, timeout_s=timeout_s)
    return dequantize_sum(gathered, compression, block, flat.size), new_residual
