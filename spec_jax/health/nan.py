"""Non-finite guard: drop a step's update inside the compiled step, count it, halt by policy.

The decision is spec_jax.core.health's state machine (`nan_guard_step`), run on device
(`jnp.where` over the state), so a NaN never reaches the parameters and the host never waits on
the device per step. The guard record travels with the step; the host reads it only when it
syncs anyway (metrics interval, checkpoint), and halts then.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from spec_jax.core.health import check_nan_guard, init_nan_guard, nan_guard_step
from spec_jax.core.spec import NanSpec


# The guard record travels as one int32 vector in this order: the step takes and donates one
# small buffer rather than four (host time per step).
FIELDS = tuple(init_nan_guard())


def _unpack(vector) -> dict:
    return {name: vector[i] for i, name in enumerate(FIELDS)}


def _pack(guard: dict) -> jax.Array:
    return jnp.stack([jnp.asarray(guard[name], jnp.int32) for name in FIELDS])


def init_guard(step: int = 0) -> jax.Array:
    return _pack(init_nan_guard(step))


def _is_finite(metrics: dict[str, Any], new_state) -> jax.Array:
    """True when the step is usable. The loss and the gradient norm are scalars the step
    computes anyway (a non-finite gradient element makes the norm non-finite); without a
    gradient norm (an opaque step) the new state's floating leaves are checked instead."""
    checks = [jnp.all(jnp.isfinite(metrics["loss"]))] if "loss" in metrics else []
    if "grad_norm" in metrics:
        checks.append(jnp.isfinite(metrics["grad_norm"]))
    else:
        floats = [x for x in jax.tree.leaves(new_state) if jnp.issubdtype(x.dtype, jnp.floating)]
        checks.append(jnp.isfinite(optax.tree.norm(floats)))
    return jnp.stack(checks).all()


def guarded(policy: NanSpec, guard, old_state, new_state, metrics):
    """(state, guard, metrics) after applying the policy to one step, all on device."""
    finite = _is_finite(metrics, new_state)
    guard, take = nan_guard_step(policy, _unpack(guard), finite, where=jnp.where)
    if "grad_norm" in metrics:  # decided before the update: XLA fuses the select into it
        state = jax.tree.map(lambda new, old: jnp.where(take, new, old), new_state, old_state)
    else:  # decided after it: copy the kept state once rather than blend it element by element
        state = jax.lax.cond(take, lambda: new_state, lambda: old_state)
    if "valid_tokens" in metrics:  # a dropped step trained on no tokens (throughput, goodput)
        metrics = {**metrics, "valid_tokens": jnp.where(take, metrics["valid_tokens"], 0.0)}
    return state, _pack(guard), {**metrics, "nonfinite": (~finite).astype(jnp.int32),
                                 "skipped_steps": guard["skipped"]}


def check(policy: NanSpec, guard) -> int:
    """Host side, at a sync point: raise HealthHalt if the guard tripped; else the skip count."""
    return check_nan_guard(policy, _unpack(jax.device_get(guard)))
