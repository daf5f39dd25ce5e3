"""The packed buffer of a compressed gradient exchange: one contiguous buffer per replica.

Byte layout (little-endian; every field starts at a multiple of 4 bytes):

    header   16 bytes: uint32 magic b"TSQ1", uint32 format (1 bf16, 2 int8),
             uint32 elements n, uint32 block (int8: elements per scale; bf16: 0)
    int8     float32 scale[blocks], then int8 payload[blocks * block], last block zero-padded
             (blocks = ceil(n / block); block a multiple of 4 keeps the total a multiple of 4)
    bf16     uint16 payload[n], then one zero uint16 if n is odd

The arithmetic, in float32, per element x (this module is its NumPy definition; the xla_ext
handlers of xla_ext/compression.cc and the jnp kernels of trainspec/jax/collectives/compression.py
compute the same bits):

- bf16: round to nearest, ties to even; a NaN becomes the quiet NaN of its sign.
- int8, per block: scale = absmax * fl(1/127) (NaN if a NaN is in the block), truncated to
  17 significant bits (float32 bits & SCALE_MASK), so that q * scale is exact; with
  s = scale if scale > 0 else 1, q = clamp(rint(x * fl(1/s)), -127, 127), rint ties to even,
  and a NaN product (NaN, or inf * 0) gives 0. Dequantized: q * scale, exact (7 + 17 bits),
  which makes the sums and residuals independent of FMA contraction. Both divisions are
  multiplications by a rounded reciprocal because XLA compiles the jnp divisions that way.

Here the float32 operations run in NumPy, which keeps subnormals; XLA:CPU's device threads,
and with them the handlers, flush them to zero. The two agree wherever no subnormal occurs.
"""
from __future__ import annotations

import numpy as np

MAGIC = int.from_bytes(b"TSQ1", "little")
FORMATS = {"bf16": 1, "int8": 2}
HEADER_BYTES = 16
INT8_MAX = np.float32(127)
INT8_INV_MAX = np.float32(1) / INT8_MAX  # fl(1/127)
SCALE_MASK = np.uint32(0xFFFFFF80)  # keeps 16 of the 23 stored mantissa bits


def blocks(n: int, block: int) -> int:
    return -(-n // block)


def packed_bytes(n: int, compression: str, block: int) -> int:
    """Size of one packed buffer of `n` elements."""
    if compression == "bf16":
        return HEADER_BYTES + 2 * (n + n % 2)
    return HEADER_BYTES + blocks(n, block) * (4 + block)


def header(n: int, compression: str, block: int) -> np.ndarray:
    fields = [MAGIC, FORMATS[compression], n, block if compression == "int8" else 0]
    return np.array(fields, "<u4").view(np.uint8)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) & 0x8000 | 0x7FC0).astype(np.uint16)
    return np.where(np.isnan(x), quiet_nan, rounded)


def quantize_int8(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 scale per block, int8 payload of shape (blocks, block))."""
    flat = np.zeros(blocks(x.size, block) * block, np.float32)
    flat[: x.size] = np.ravel(x)
    rows = flat.reshape(-1, block)
    with np.errstate(invalid="ignore", divide="ignore"):
        scales = np.max(np.abs(rows), axis=1) * INT8_INV_MAX
        scales = (scales.view(np.uint32) & SCALE_MASK).view(np.float32)
        inverse = np.float32(1) / np.where(scales > 0, scales, np.float32(1))
        q = np.rint(rows * inverse[:, None])
    q = np.where(np.isnan(q), 0, np.clip(q, -INT8_MAX, INT8_MAX))
    return scales.astype(np.float32), q.astype(np.int8)


def pack(x: np.ndarray, compression: str, block: int) -> np.ndarray:
    """The packed buffer (uint8) of the float32 values `x`."""
    x = np.ravel(np.asarray(x, np.float32))
    if compression == "bf16":
        payload = np.zeros(x.size + x.size % 2, "<u2")
        payload[: x.size] = bf16_bits(x)
        body = [payload.view(np.uint8)]
    else:
        scales, q = quantize_int8(x, block)
        body = [scales.astype("<f4").view(np.uint8), q.view(np.uint8).ravel()]
    return np.concatenate([header(x.size, compression, block), *body])


def unpack(packed: np.ndarray, compression: str, block: int, n: int) -> np.ndarray:
    """The float32 values one packed buffer carries (checks its header)."""
    packed = np.asarray(packed, np.uint8)
    if packed.size != packed_bytes(n, compression, block) or not np.array_equal(
            packed[:HEADER_BYTES], header(n, compression, block)):
        raise ValueError(f"not a packed {compression} buffer of {n} elements, block {block}")
    body = packed[HEADER_BYTES:]
    if compression == "bf16":
        return (body.view("<u2")[:n].astype(np.uint32) << 16).view(np.float32)
    nb = blocks(n, block)
    scales = body[: 4 * nb].view("<f4").astype(np.float32)
    q = body[4 * nb:].view(np.int8).reshape(nb, block).astype(np.float32)
    with np.errstate(invalid="ignore"):
        return (q * scales[:, None]).ravel()[:n]
