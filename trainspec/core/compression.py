"""Compressed gradient reduction (`collectives.compression`): the framework-free reference.

What one replica transmits, and keeps, for its flat (packed) gradient `x` in one step:
- `bf16`: x rounded to bfloat16 (round to nearest, ties to even);
- `int8`: x cut into blocks of `block` elements (the last one zero-padded), each sent as int8
  `round(x / scale)` with one float32 `scale = max|x| / 127` per block.
Error feedback (1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et al. 2019): the replica
compresses `x + residual` and keeps what compression lost as the next residual, so over steps
sum(transmitted) + residual = sum(x): nothing is lost, only delayed.

The exchange over n replicas has two compressed stages (`two_stage_sum`), so that every replica
sends about 2(n-1)/n of its compressed buffer, as a ring all-reduce does of the float32 one:
1. each replica compresses its whole buffer, cut into n chunks, and sends chunk j to replica j
   (all-to-all); replica j decompresses the n pieces and sums them in float32, in rank order;
2. replica j compresses its summed chunk again and every replica gathers all n (all-gather).
What stage 2 loses on chunk j is added to replica j's residual at those elements: the
residuals then sum to everything the replicas' transmissions still owe, and error feedback
covers both stages with one residual per replica.

The jnp implementation (trainspec.jax.collectives.compression) is tested against this module.
"""
from __future__ import annotations

import numpy as np

COMPRESSIONS = ("none", "bf16", "int8")
INT8_MAX = 127
# Blocks of a multiple of 4 elements keep the packed buffer (header, float32 scales, int8
# payload; trainspec/core/packed.py) a whole number of 4-byte words.
BLOCK_ALIGN = 4
# The train-state field holding each replica's error-feedback residual.
RESIDUAL = "ef_residual"


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
    of x * fl(1/scale) (trainspec/core/packed.py defines the float32 arithmetic)."""
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


def chunk_size(size: int, replicas: int, compression: str, block: int) -> int:
    """Elements of each replica's chunk in the two-stage exchange: the packed buffer of `size`
    elements is zero-padded to `replicas` chunks of whole int8 blocks."""
    return padded_size(-(-size // replicas), block if compression == "int8" else 1)


def two_stage_sum(xs: list[np.ndarray], residuals: list[np.ndarray], compression: str,
                  block: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the sum every replica receives, each replica's new residual), float64: the reference
    of the two-stage exchange above, for replicas' flat buffers `xs` and their residuals."""
    n, size = len(xs), np.size(xs[0])
    chunk = chunk_size(size, n, compression, block)
    padded = np.zeros((n, n * chunk))
    padded[:, :size] = np.asarray(xs, np.float64) + np.asarray(residuals, np.float64)
    sent = np.stack([round_trip(c.astype(np.float32), compression, block) for c in padded])
    shards = sent.sum(axis=0).reshape(n, chunk)  # chunk j, summed on replica j
    gathered = np.stack([round_trip(s.astype(np.float32), compression, block) for s in shards])
    new = padded - sent
    for j in range(n):  # stage 2's loss on chunk j is owed by replica j
        new[j, j * chunk:(j + 1) * chunk] += shards[j] - gathered[j]
    return gathered.ravel()[:size], [r[:size] for r in new]
