"""Compressed gradient reduction with error feedback (`collectives.compression`), plain jnp.

The rule and its float64 reference are spec_jax.core.compression. Here: the quantizers, the
reduction of one replica's packed gradient inside a `shard_map` over the data axes, and the
train state that carries each replica's residual (docs/communication.md).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.core.compression import INT8_MAX, padded_size
from spec_jax.core.packed import INT8_INV_MAX, SCALE_MASK


def quantize_int8(flat: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(int8 payload of shape (blocks, block), float32 scale per block); zero-padded.
    The arithmetic is spec_jax.core.packed's, which the ext handlers share bit for bit."""
    padded = jnp.pad(flat.astype(jnp.float32), (0, padded_size(flat.size, block) - flat.size))
    blocks = padded.reshape(-1, block)
    # Multiplications by rounded reciprocals, written out: XLA rewrites a division by a constant
    # or by a broadcast value into them anyway, and the ext handlers must do what XLA does.
    scales = jnp.max(jnp.abs(blocks), axis=1) * INT8_INV_MAX
    # 17 significant bits: q * scale is then exact, whether or not XLA contracts it with the
    # sum or the residual's subtraction into an FMA (it does, on hosts that have FMA).
    scales = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(scales, jnp.uint32) & SCALE_MASK, jnp.float32)
    inverse = 1.0 / jnp.where(scales > 0, scales, 1.0)
    payload = jnp.clip(jnp.round(blocks * inverse[:, None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return payload, scales


def dequantize_int8(payload: jax.Array, scales: jax.Array, size: int) -> jax.Array:
    values = payload.astype(jnp.float32) * scales[..., None]  # exact (quantize_int8)
    return values.reshape(*payload.shape[:-2], -1)[..., :size]


def round_trip(flat: jax.Array, compression: str, block: int) -> jax.Array:
    """What the receivers see of `flat` (float32)."""
    if compression == "bf16":
        return flat.astype(jnp.bfloat16).astype(jnp.float32)
    return dequantize_int8(*quantize_int8(flat, block), flat.size)


def compressed_sum(flat: jax.Array, residual: jax.Array, group, compression: str,
                   block: int) -> tuple[jax.Array, jax.Array]:
    """(sum over `group` of every replica's compressed `flat + residual`, this replica's new
    residual). Inside a shard_map over the data axes `group`.

    The compressed buffers are all-gathered (bfloat16; or int8 payload and float32 scales) and
    every replica decompresses and sums them in float32 in rank order: all replicas hold the
    same sum, bit for bit, and the sum adds no rounding of its own to what error feedback sees.
    (An all-reduce would sum on the wire: int8 would overflow, and XLA:CPU promotes a bfloat16
    all-reduce to float32, sending no fewer bytes.)
    """
    corrected = flat.astype(jnp.float32) + residual
    if compression == "bf16":
        # as uint16 bits: XLA would otherwise move the float32 convert before the gather
        bits = jax.lax.bitcast_convert_type(corrected.astype(jnp.bfloat16), jnp.uint16)
        gathered = jax.lax.all_gather(bits, group)
        per_rank = jax.lax.bitcast_convert_type(gathered, jnp.bfloat16).astype(jnp.float32)
    else:
        gathered = jax.lax.all_gather(quantize_int8(corrected, block), group)
        per_rank = dequantize_int8(*gathered, flat.size)
    total = functools.reduce(jnp.add, list(per_rank))  # fixed rank order: deterministic
    return total, corrected - per_rank[jax.lax.axis_index(group)]


# -- the residual in the train state ----------------------------------------------------------
RESIDUAL = "ef_residual"


@functools.cache
def _with_residual_type(state_type: type) -> type:
    """`state_type` (a flax struct, e.g. TrainState) with one more pytree field, the residual."""
    namespace = {"__annotations__": {RESIDUAL: Any}, "__module__": __name__}
    return flax.struct.dataclass(type(f"{state_type.__name__}WithResidual", (state_type,), namespace))


def with_residual(state, residual):
    """`state` (a flax struct dataclass) carrying `residual` as one more field."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    return _with_residual_type(type(state))(**fields, **{RESIDUAL: residual})


def residual_like(params, replicas: int, make=jnp.zeros):
    """One float32 residual per replica for every parameter: shape (replicas, *param.shape)."""
    return jax.tree.map(lambda p: make((replicas, *p.shape), jnp.float32), params)
