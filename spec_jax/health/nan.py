"""Non-finite guard: drop a step's update inside the compiled step, count it, halt by policy.

A step is non-finite when its loss, its gradient norm or any floating array of the state it
produced is not finite: the last is a reduction fused into the step, and catches what the loss
cannot see (an infinite learning rate turns finite gradients into NaN parameters). The decision
is spec_jax.core.health's state machine (`nan_guard_step`), run on device (a `lax.cond` keeps
the old state or the new), so a NaN never reaches the parameters, nor a checkpoint, and the host
never waits on the device per step. The guard record travels with the step; the host reads it only when it
syncs anyway (metrics interval, checkpoint), and halts then.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.core.health import check_nan_guard, init_nan_guard, nan_guard_counts, nan_guard_step
from spec_jax.core.spec import NanSpec


# The guard record travels as one int32 vector in this order: the step takes and donates one
# small buffer rather than four (host time per step).
FIELDS = tuple(init_nan_guard())


def _unpack(vector) -> dict:
    return {name: vector[i] for i, name in enumerate(FIELDS)}


def _pack(guard: dict) -> jax.Array:
    return jnp.stack([jnp.asarray(guard[name], jnp.int32) for name in FIELDS])


def init_guard(step: int = 0, skipped: int = 0, consecutive: int = 0) -> jax.Array:
    return _pack(init_nan_guard(step, skipped, consecutive))


def _is_finite(metrics: dict[str, Any], new_state) -> jax.Array:
    """True when the step is usable: the loss and gradient norm where the step reports them,
    and every element of the new state's floating arrays (elementwise: a norm would overflow
    on large finite values)."""
    checks = [jnp.all(jnp.isfinite(metrics["loss"]))] if "loss" in metrics else []
    if "grad_norm" in metrics:
        checks.append(jnp.isfinite(metrics["grad_norm"]))
    checks += [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(new_state)
               if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.stack(checks).all()


def guarded(policy: NanSpec, guard, old_state, new_state, metrics):
    """(state, guard, metrics) after applying the policy to one step, all on device."""
    finite = _is_finite(metrics, new_state)
    guard, take = nan_guard_step(policy, _unpack(guard), finite, where=jnp.where)
    # The decision needs the new state, so it comes after the update: a cond copies the kept
    # state once, where a per-element select would read both states and write a third.
    state = jax.lax.cond(take, lambda: new_state, lambda: old_state)
    if "valid_tokens" in metrics:  # a dropped step trained on no tokens (throughput, goodput)
        metrics = {**metrics, "valid_tokens": jnp.where(take, metrics["valid_tokens"], 0.0)}
    return state, _pack(guard), {**metrics, "nonfinite": (~finite).astype(jnp.int32),
                                 "skipped_steps": guard["skipped"]}


def check(policy: NanSpec, guard) -> int:
    """Host side, at a sync point: raise HealthHalt if the guard tripped; else the skip count."""
    return check_nan_guard(policy, _unpack(jax.device_get(guard)))


def counts(guard) -> dict[str, int]:
    """Host side: the guard's counts to checkpoint with the state (see nan_guard_counts)."""
    return nan_guard_counts(_unpack(jax.device_get(guard)))
