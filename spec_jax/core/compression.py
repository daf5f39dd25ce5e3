"""Compressed gradient reduction (`collectives.compression`): the framework-free reference.

What one replica transmits, and keeps, for its flat (packed) gradient `x` in one step:
- `bf16`: x rounded to bfloat16 (round to nearest, ties to even);
- `int8`: x cut into blocks of `block` elements (the last one zero-padded), each sent as int8
  `round(x / scale)` with one float32 `scale = max|x| / 127` per block.
Error feedback (1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et al. 2019): the replica
compresses `x + residual` and keeps what compression lost as the next residual, so over steps
sum(transmitted) + residual = sum(x): nothing is lost, only delayed.

The jnp implementation (spec_jax.collectives.compression) is tested against this module.
"""
from __future__ import annotations

import numpy as np

COMPRESSIONS = ("none", "bf16", "int8")
INT8_MAX = 127
# Blocks of a multiple of 4 elements keep the packed buffer (header, float32 scales, int8
# payload; spec_jax/core/packed.py) a whole number of 4-byte words.
BLOCK_ALIGN = 4


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32:
    the top 16 bits of the float32 pattern after adding half an ulp of bfloat16."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def padded_size(size: int, block: int) -> int:
    return -(-size // block) * block


def quantize_int8(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(int8 payload, zero-padded to whole blocks; float32 scale per block)."""
    flat = np.zeros(padded_size(x.size, block), np.float64)
    flat[: x.size] = np.ravel(x)
    blocks = flat.reshape(-1, block)
    scales = (np.max(np.abs(blocks), axis=1) / INT8_MAX).astype(np.float32)
    safe = np.where(scales > 0, scales, 1).astype(np.float64)
    payload = np.clip(np.rint(blocks / safe[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return payload.ravel(), scales


def dequantize_int8(payload: np.ndarray, scales: np.ndarray, block: int, size: int) -> np.ndarray:
    blocks = payload.reshape(-1, block).astype(np.float64) * scales.astype(np.float64)[:, None]
    return blocks.ravel()[:size]


def round_trip(x: np.ndarray, compression: str, block: int) -> np.ndarray:
    """What the receivers see of `x` (float64)."""
    if compression == "none":
        return np.asarray(x, np.float64)
    if compression == "bf16":
        return round_to_bf16(x).astype(np.float64)
    return dequantize_int8(*quantize_int8(x, block), block, np.size(x)).reshape(np.shape(x))


def error_bound(x: np.ndarray, compression: str, block: int) -> np.ndarray:
    """Per-element bound on |x - round_trip(x)|.

    bf16 keeps 8 significant bits: rounding to nearest errs by at most half an ulp, 2^-8 |x|
    (normal range; gradients far below 1e-38 flush with it). int8 errs by at most half a step,
    scale / 2 <= max|block| / 254 * (1 + 2^-23), plus 2^-23 |x| from the two float32 roundings
    of x * fl(1/scale) (spec_jax/core/packed.py defines the float32 arithmetic)."""
    x = np.asarray(x, np.float64)
    if compression == "none":
        return np.zeros_like(x)
    if compression == "bf16":
        return np.abs(x) * 2.0**-8
    flat = np.zeros(padded_size(x.size, block))
    flat[: x.size] = np.abs(x.ravel())
    block_max = np.repeat(flat.reshape(-1, block).max(axis=1), block)[: x.size]
    bound = block_max * (0.5 / INT8_MAX) * (1 + 2.0**-22) + np.abs(x.ravel()) * 2.0**-23 * 1.001
    return bound.reshape(x.shape)


def error_feedback_step(x: np.ndarray, residual: np.ndarray, compression: str,
                        block: int) -> tuple[np.ndarray, np.ndarray]:
    """(transmitted, new residual) of one replica in one step, float64."""
    corrected = np.asarray(x, np.float64) + residual
    sent = round_trip(corrected.astype(np.float32), compression, block)
    return sent, corrected - sent
