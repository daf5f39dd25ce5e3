"""Compressed gradient reduction with error feedback (`collectives.compression`), plain jnp.

The rule and its float64 reference are trainspec.core.compression. Here: the quantizers, the
two-stage reduction of one replica's packed gradient inside a `shard_map` over the data axes, and the
train state that carries each replica's residual (docs/communication.md).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from trainspec.core.compression import INT8_MAX, RESIDUAL, chunk_size, padded_size
from trainspec.core.packed import INT8_INV_MAX, SCALE_MASK


def quantize_int8(flat: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(int8 payload of shape (blocks, block), float32 scale per block); zero-padded.
    The arithmetic is trainspec.core.packed's, which the ext handlers share bit for bit."""
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


def feedback_round_trip(x: jax.Array, residual: jax.Array, compression: str,
                        block: int) -> tuple[jax.Array, jax.Array]:
    """(what the receivers see of x + residual, what that lost): one replica's error feedback."""
    corrected = x + residual
    sent = round_trip(corrected, compression, block)
    return sent, corrected - sent


def _encode(chunks: jax.Array, compression: str, block: int):
    """What goes on the wire for rows of float32 `chunks` (rows, chunk): bfloat16 as its uint16
    bits (XLA would otherwise move the float32 convert before the collective), or the int8
    payload (rows, blocks, block) and float32 scales (rows, blocks)."""
    if compression == "bf16":
        return jax.lax.bitcast_convert_type(chunks.astype(jnp.bfloat16), jnp.uint16)
    payload, scales = quantize_int8(chunks.reshape(-1), block)
    return payload.reshape(chunks.shape[0], -1, block), scales.reshape(chunks.shape[0], -1)


def _decode(wire, compression: str) -> jax.Array:
    """float32 rows (rows, chunk) of what `_encode` put on the wire."""
    if compression == "bf16":
        return jax.lax.bitcast_convert_type(wire, jnp.bfloat16).astype(jnp.float32)
    return dequantize_int8(*wire, wire[0].shape[-2] * wire[0].shape[-1])


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One backend's pieces of the two-stage exchange, on rows of float32 chunks (k, chunk)."""

    encode: Callable  # (rows, residual rows) -> (wire, rows + residual - what the wire carries)
    decode: Callable  # wire of k rows -> float32 (k, chunk)
    all_to_all: Callable  # wire of n rows -> wire of n rows, row i from replica i
    all_gather: Callable  # wire of 1 row -> wire of n rows, row i from replica i


def two_stage_sum(flat: jax.Array, residual: jax.Array | None, group, replicas: int, chunk: int,
                  exchange: Exchange) -> tuple[jax.Array, jax.Array | None]:
    """(sum over `group` of every replica's compressed `flat + residual`, this replica's new
    residual). Inside a shard_map over the data axes `group`, of `replicas` members. Without a
    residual (collectives.error_feedback = false) the losses are dropped and None returned.

    trainspec.core.compression.two_stage_sum: an all-to-all of compressed chunks, a float32 sum
    of each chunk in rank order on its owner, and an all-gather of the compressed sums. Every
    replica decodes the same gathered bytes, so all hold the same sum bit for bit. (An
    all-reduce would sum on the wire: int8 would overflow, and XLA:CPU promotes a bfloat16
    all-reduce to float32, sending no fewer bytes.)
    """
    size = flat.size
    rows = lambda v: jnp.pad(  # noqa: E731
        v.astype(jnp.float32), (0, replicas * chunk - size)).reshape(replicas, chunk)
    zeros = jnp.zeros((replicas, chunk), jnp.float32)
    wire, owed = exchange.encode(rows(flat), zeros if residual is None else rows(residual))
    shard = functools.reduce(jnp.add, list(exchange.decode(exchange.all_to_all(wire))))
    shard_wire, lost = exchange.encode(shard[None], zeros[:1])
    total = exchange.decode(exchange.all_gather(shard_wire)).reshape(-1)[:size]
    if residual is None:
        return total, None
    # stage 1 lost `owed` of this replica's buffer; stage 2 lost `lost` of the chunk it owns:
    # this replica owes both (core.compression.two_stage_sum)
    mine = jax.lax.axis_index(group)
    owed = jax.lax.dynamic_update_index_in_dim(owed, owed[mine] + lost[0], mine, 0)
    return total, owed.reshape(-1)[:size]


def compressed_sum(flat: jax.Array, residual: jax.Array | None, group, replicas: int,
                   compression: str, block: int,
                   timeout_s: float | None = None) -> tuple[jax.Array, jax.Array | None]:
    """two_stage_sum with the jnp quantizers and XLA's all-to-all and all-gather (which take
    no timeout: `timeout_s` is there for the signature every backend's kernels share)."""
    def encode(rows, residual_rows):
        corrected = rows + residual_rows
        wire = _encode(corrected, compression, block)
        return wire, corrected - _decode(wire, compression)

    exchange = Exchange(
        encode, functools.partial(_decode, compression=compression),
        lambda wire: jax.tree.map(lambda w: jax.lax.all_to_all(w, group, 0, 0), wire),
        lambda wire: jax.tree.map(lambda w: jax.lax.all_gather(w, group, tiled=True), wire))
    return two_stage_sum(flat, residual, group, replicas,
                         chunk_size(flat.size, replicas, compression, block), exchange)


# -- the residual in the train state ----------------------------------------------------------


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
