"""Gradient noise scale inside the step, from sums the step computes anyway (docs/advice.md).

Two batch sizes come for free in data-parallel training: each replica's gradient before the
cross-replica reduction (B_small = the replica's valid tokens) and the reduced one (B_big =
the global batch's). With a single replica, the micro-batches of accumulation play the small
batch. Only squared norms are added to the step: one pass over the gradient per replica (or
per micro-batch) and a scalar per replica; no gradient is copied or reduced twice.

The per-step parts are unbiased but noisy; the host estimates the run's current state from the
recent steps (trainspec.core.gns) when it writes a record, so the step never waits on the host.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from trainspec.core.gns import MICRO_BATCHES, REPLICAS, resolve, unbiased_parts  # noqa: F401


def sq_norm(tree) -> jax.Array:
    """Squared L2 norm of a pytree, accumulated in float32."""
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def stacked_sq_norms(tree) -> jax.Array:
    """Squared norm of each slice along the leading axis of every leaf: shape (n,)."""
    return sum(
        # summed over the trailing axes in place: a reshape could regather a sharded leaf
        jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
        for x in jax.tree.leaves(tree)
    )


def step_parts(small_sq, b_small, big_sq, b_big) -> dict[str, jax.Array]:
    """Step metrics `gns_grad_sq`, `gns_trace` from the mean |G_small|^2 over small batches of
    mean size `b_small` and |G_big|^2 over the big batch of `b_big`."""
    grad_sq, trace = unbiased_parts(small_sq, big_sq, b_small, b_big)
    return {"gns_grad_sq": grad_sq, "gns_trace": trace}


def mean_sq(grad_sum, count) -> jax.Array:
    """|G|^2 of the mean gradient, from a gradient summed over `count` tokens (or rows)."""
    return sq_norm(grad_sum) / jnp.square(jnp.maximum(count, 1.0))


def replica_parts(grad_sums, token_sums, grad_sum, tokens) -> dict[str, jax.Array]:
    """`grad_sums`/`token_sums`: per-replica sums stacked on a leading axis (before the
    reduction); `grad_sum`/`tokens`: after it. |G_small|^2 is the mean over replicas."""
    token_sums = jnp.maximum(token_sums, 1.0)
    small_sq = jnp.mean(stacked_sq_norms(grad_sums) / jnp.square(token_sums))
    return step_parts(small_sq, jnp.mean(token_sums), mean_sq(grad_sum, tokens), tokens)


def micro_parts(micro_sq_sum, k: int, grad_sum, tokens) -> dict[str, jax.Array]:
    """`micro_sq_sum`: the sum over the k micro-batches of each one's `mean_sq`."""
    return step_parts(micro_sq_sum / k, tokens / k, mean_sq(grad_sum, tokens), tokens)
