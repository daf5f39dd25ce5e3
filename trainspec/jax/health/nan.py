"""Non-finite guards.

The default (`health.nan.policy = rollback`) adds nothing to the step: the run loop judges each
step a few steps late by the loss and gradient norm the step computes anyway, and checks the
state itself (`state_is_finite`) only before each checkpoint and at the end, so no checkpoint
holds a non-finite element; a bad step is undone by a rollback to the newest good checkpoint
(trainspec.core.run, trainspec.core.bad_steps). Checking the state after every step cost 1.04-
1.08x of the wrapped step on 8 simulated devices (docs/wrapping.md).

The opt-in `skip` and `halt` policies (`guarded`) drop a step's update inside the step, count
it, and halt by policy, as follows.

A step is non-finite when its loss, its gradient norm or any floating array of the state it
produced is not finite: the last is a reduction fused into the step, and catches what the loss
cannot see (an infinite learning rate turns finite gradients into NaN parameters). The decision
is trainspec.core.health's state machine (`nan_guard_step`), run on device (a `lax.cond` keeps
the old state or the new), so a NaN never reaches the parameters, nor a checkpoint, and the host
never waits on the device per step. The guard record travels with the step; the host reads it
only when it syncs anyway (metrics interval, checkpoint), and halts then.

The state check reads each element once over the mesh, not once per device: a device holds its
leaves' blocks replicated over the mesh axes that do not split them (with data parallelism, all
of it on every device), so each device checks 1/r of each block (r: the devices holding that
block), and one all-reduce of one integer counts the non-finite slices. On 8 simulated devices
checking every copy cost more (docs/results.md, "What wrap() costs").
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from trainspec.core.health import check_nan_guard, init_nan_guard, nan_guard_counts, nan_guard_step
from trainspec.core.spec_health import NanSpec


# The guard record travels as one int32 vector in this order: the step takes and donates one
# small buffer rather than four (host time per step).
FIELDS = tuple(init_nan_guard())


def _unpack(vector) -> dict:
    """The record's fields; a (groups, FIELDS) array (semi_sync: one guard per group) gives
    each field per group."""
    return {name: vector[..., i] for i, name in enumerate(FIELDS)}


def _pack(guard: dict) -> jax.Array:
    return jnp.stack([jnp.asarray(guard[name], jnp.int32) for name in FIELDS], axis=-1)


def init_guard(step: int = 0, skipped: int = 0, consecutive: int = 0,
               groups: int | None = None) -> jax.Array:
    """The record; with `groups`, one per group (semi_sync), each starting from these counts."""
    record = _pack(init_nan_guard(step, skipped, consecutive))
    return record if groups is None else jnp.broadcast_to(record, (groups, len(FIELDS)))


def _my_slice(block: jax.Array, pspec: P, mesh: Mesh) -> tuple[jax.Array, bool]:
    """(this device's 1/r of its local block of a leaf laid out by `pspec`, whether that is
    less than the block), inside shard_map; r is the number of devices holding the same block:
    those along the mesh axes `pspec` does not split. The slices have one length,
    ceil(block / r); the last ones end at the block's end, overlapping a neighbour (padding
    would copy the block). Together they cover it."""
    used = {a for part in pspec if part is not None
            for a in (part if isinstance(part, tuple) else (part,))}
    holders = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
    flat = block.ravel()
    if not holders:
        return flat, False
    length = -(-flat.size // math.prod(mesh.shape[a] for a in holders))
    start = jnp.minimum(jax.lax.axis_index(holders) * length, flat.size - length)
    return jax.lax.dynamic_slice(flat, (start,), (length,)), True


def _has_nonfinite(x: jax.Array, sliced: bool) -> jax.Array:
    """Whether the vector `x` holds an inf or NaN, elementwise (a norm or a sum would overflow
    on large finite values), by the cheaper of two exact reductions on XLA:CPU:
    - a whole block: its largest |x| is finite exactly when every element is (the maximum
      propagates NaN); reducing floats by max runs about 5x faster on XLA:CPU than `all` of
      `isfinite`'s booleans;
    - a slice: `all(isfinite)`, which XLA:CPU fuses with the dynamic slice into one loop; its
      max reduction (a YNNPACK kernel) takes only whole arrays, so the slice was first copied
      out, and the wrapped step on 8 devices was slower with it (docs/wrapping.md)."""
    if sliced:
        return jnp.logical_not(jnp.all(jnp.isfinite(x)))
    return jnp.logical_not(jnp.isfinite(jnp.max(jnp.abs(x))))


def _bad_slices(blocks, specs, mesh: Mesh) -> jax.Array:
    """Inside shard_map: how many of this device's slices of `blocks` hold a non-finite
    element."""
    return sum((_has_nonfinite(*_my_slice(b, ps, mesh)).astype(jnp.int32)
                for b, ps in zip(blocks, specs)), jnp.int32(0))


def _floating(state, pspecs) -> tuple[list, list]:
    """The state's floating, non-empty leaves and their PartitionSpecs."""
    pairs = [(x, ps) for ps, x in zip(jax.tree.leaves(pspecs, is_leaf=lambda x: isinstance(x, P)),
                                      jax.tree.leaves(state))
             if jnp.issubdtype(x.dtype, jnp.floating) and x.size]
    return [x for x, _ in pairs], [ps for _, ps in pairs]


def state_is_finite(new_state, mesh: Mesh, pspecs, groups: tuple[str, ...] = ()) -> jax.Array:
    """Every element of the state's floating arrays is finite (elementwise: a norm would
    overflow on large finite values); each device reads its slices, one all-reduce.

    `groups`: mesh axes along which the state's leaves are independent copies (semi_sync's
    data-parallel groups, leading axis split over them): then one flag per group, (groups,),
    split over those axes, and the all-reduce runs over the other axes only."""
    leaves, specs = _floating(new_state, pspecs)

    def count_bad(blocks):
        bad = _bad_slices(blocks, specs, mesh)
        across = tuple(a for a in mesh.axis_names if a not in groups and mesh.shape[a] > 1)
        bad = jax.lax.psum(bad, across) if across else bad
        return bad[None] if groups else bad

    return jax.shard_map(count_bad, mesh=mesh, in_specs=(specs,), out_specs=P(groups) if groups else P(),
                         check_vma=False)(leaves) == 0


def guarded(policy: NanSpec, guard, old_state, new_state, metrics: dict[str, Any],
            mesh: Mesh, pspecs):
    """(state, guard, metrics) after applying the policy to one step, all on device.
    `pspecs`: the state's PartitionSpecs on `mesh` (a pytree like the state)."""
    # The check's all-reduce starts only once the whole step is done: one beside a blocking
    # xla_ext custom call (a leaf ready before the backend's last collective) deadlocked the
    # CPU runtime (docs/xla_ext.md, "Ordering").
    new_state, metrics = jax.lax.optimization_barrier((new_state, metrics))
    checks = [state_is_finite(new_state, mesh, pspecs)]
    if "loss" in metrics:
        checks.append(jnp.all(jnp.isfinite(metrics["loss"])))
    if "grad_norm" in metrics:
        checks.append(jnp.isfinite(metrics["grad_norm"]))
    finite = jnp.stack(checks).all()
    guard, take = nan_guard_step(policy, _unpack(guard), finite, where=jnp.where)
    # The decision needs the new state, so it comes after the update: a cond copies the kept
    # state once, where a per-element select would read both states and write a third.
    state = jax.lax.cond(take, lambda: new_state, lambda: old_state)
    return state, _pack(guard), _guarded_metrics(metrics, finite, take, guard)


def guarded_groups(policy: NanSpec, guards, old_state, new_state, metrics: dict[str, Any],
                   mesh: Mesh, pspecs, groups: tuple[str, ...]):
    """`guarded` with one guard per data-parallel group (semi_sync): every leaf of the state
    and of the metrics has a leading group axis split over the mesh axes `groups`, `guards`
    is (groups, FIELDS), and each group keeps or drops its own update on its own flag. No
    value crosses the `groups` axes: the groups' guards are combined on the host (`check`)."""
    new_state, metrics = jax.lax.optimization_barrier((new_state, metrics))
    finite = (state_is_finite(new_state, mesh, pspecs, groups)
              & jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]))
    guards, take = nan_guard_step(policy, _unpack(guards), finite, where=jnp.where)
    # A select per element (a cond cannot choose per group): each group's rows of the new
    # state or of the old.
    state = jax.tree.map(
        lambda new, old: jnp.where(take.reshape(take.shape + (1,) * (new.ndim - 1)), new, old),
        new_state, old_state)
    return state, _pack(guards), _guarded_metrics(metrics, finite, take, guards)


def _guarded_metrics(metrics: dict[str, Any], finite, take, guard) -> dict[str, Any]:
    if "valid_tokens" in metrics:  # a dropped step trained on no tokens (throughput, goodput)
        metrics = {**metrics, "valid_tokens": jnp.where(take, metrics["valid_tokens"], 0.0)}
    return {**metrics, "nonfinite": (~finite).astype(jnp.int32), "skipped_steps": guard["skipped"]}


def _host_records(guard) -> list[dict]:
    """The guard on the host: one record, or one per group (semi_sync: pass an array already
    on the host where the groups span processes)."""
    vector = np.asarray(jax.device_get(guard))
    return [_unpack(row) for row in vector.reshape(-1, len(FIELDS))]


def check(policy: NanSpec, guard) -> int:
    """Host side, at a sync point: raise HealthHalt if the guard tripped (with one guard per
    group: any group's, at the earliest step one tripped); else the skip count (per group:
    the most steps any one group dropped)."""
    records = _host_records(guard)
    tripped = [r for r in records if r["tripped_at"] >= 0]
    if tripped:
        return check_nan_guard(policy, min(tripped, key=lambda r: int(r["tripped_at"])))
    return max(check_nan_guard(policy, r) for r in records)


def counts(guard) -> dict[str, int]:
    """Host side: the guard's counts to checkpoint with the state (see nan_guard_counts); per
    group, the largest of each."""
    per_group = [nan_guard_counts(r) for r in _host_records(guard)]
    return {k: max(c[k] for c in per_group) for k in per_group[0]}
