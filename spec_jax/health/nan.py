"""Non-finite guard: drop a step's update inside the compiled step, count it, halt by policy.

The decision is made on device (`jnp.where` over the state), so a NaN never reaches the
parameters and the host never waits on the device per step. A small guard record travels with
the step; the host reads it only when it syncs anyway (metrics interval, checkpoint), and halts
then. Once tripped the guard freezes the state, so what the host checkpoints at a halt is the
state before the first bad step, however many steps were dispatched after it.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from spec_jax.health.errors import HealthHalt
from spec_jax.spec import NanSpec


def init_guard(step: int = 0) -> dict[str, jax.Array]:
    """`step`: the number of steps already taken (the data position), so messages name steps."""
    return {
        "step": jnp.int32(step),          # steps taken through this guard
        "skipped": jnp.int32(0),          # non-finite steps dropped, total
        "consecutive": jnp.int32(0),      # ... in a row, up to the last step
        "tripped_at": jnp.int32(-1),      # step (1-based) at which the guard halted; -1 = not
    }


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
    step = guard["step"] + 1
    consecutive = jnp.where(finite, 0, guard["consecutive"] + 1)
    limit = 0 if policy.policy == "halt" else policy.max_consecutive_skips
    was_tripped = guard["tripped_at"] >= 0
    trips = ~was_tripped & (consecutive > limit)
    take = finite & ~was_tripped
    state = jax.tree.map(lambda new, old: jnp.where(take, new, old), new_state, old_state)
    guard = {
        "step": step,
        "skipped": guard["skipped"] + jnp.where(finite | was_tripped, 0, 1).astype(jnp.int32),
        "consecutive": jnp.where(was_tripped, guard["consecutive"], consecutive),
        "tripped_at": jnp.where(trips, step, guard["tripped_at"]),
    }
    if "valid_tokens" in metrics:  # a dropped step trained on no tokens (throughput, goodput)
        metrics = {**metrics, "valid_tokens": jnp.where(take, metrics["valid_tokens"], 0.0)}
    return state, guard, {**metrics, "nonfinite": (~finite).astype(jnp.int32),
                          "skipped_steps": guard["skipped"]}


def check(policy: NanSpec, guard) -> int:
    """Host side, at a sync point: raise HealthHalt if the guard tripped; else the skip count."""
    g = {k: int(v) for k, v in jax.device_get(guard).items()}
    if g["tripped_at"] >= 0:
        bad = g["tripped_at"]
        if policy.policy == "halt":
            why = "health.nan.policy = halt"
        else:
            why = (f"more than health.nan.max_consecutive_skips = "
                   f"{policy.max_consecutive_skips} consecutive non-finite steps")
        raise HealthHalt(
            f"non-finite loss or gradients at step {bad} ({why}); halted with the state "
            f"after step {bad - 1} kept",
            last_good_step=bad - 1,
        )
    return g["skipped"]
