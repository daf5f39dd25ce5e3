"""The step forms trainspec can see into, and the accumulation arithmetic they share.

- `loss_step(loss_fn)`: `loss_fn(params, batch) -> (loss_sum, valid_tokens, aux)` with the optax
  optimizer inside a flax `TrainState`: micro-batch accumulation normalised by the valid tokens
  of the whole global batch (trainspec.core.accumulation), precision casts, GNS;
- `grad_step(grad_fn, update_fn)`: a plain step split at its gradient (GNS over replicas).

trainspec.jax.step wraps either (or an opaque step) into the jitted, sharded step.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainspec.core.accumulation import interleaved_micro_batches
from trainspec.core.errors import UserInputError
from trainspec.jax.metrics import gns

LossFn = Callable[[Any, Any], tuple[jax.Array, jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class LossStep:
    """A train step whose gradient computation trainspec can see (and so accumulate).

    Called directly it is an ordinary single-batch step, so the same object runs with or
    without trainspec. `aux` values returned by `loss_fn` are summed over micro-batches.
    """

    loss_fn: LossFn

    def __call__(self, state, batch):
        return accumulated_step(self.loss_fn, state, split_micro(batch, 1), None)


def loss_step(loss_fn: LossFn) -> LossStep:
    return LossStep(loss_fn)


@dataclasses.dataclass(frozen=True)
class GradStep:
    """A plain step split at its gradient, so that trainspec sees the gradient of each
    data-parallel replica before the reduction (and so measures GNS; docs/wrapping.md).

    `grad_fn(params, batch) -> (grads, metrics)`: the mean gradient over the batch's rows and
    a dict of scalars (averaged over replicas); `update_fn(state, grads) -> state`. Called
    directly it is the ordinary step `update_fn(state, grad_fn(state.params, batch)[0])`.
    """

    grad_fn: Callable[[Any, Any], tuple[Any, dict]]
    update_fn: Callable[[Any, Any], Any]

    def __call__(self, state, batch):
        grads, metrics = self.grad_fn(state.params, batch)
        return self.update_fn(state, grads), metrics


def grad_step(grad_fn, update_fn) -> GradStep:
    return GradStep(grad_fn, update_fn)


def split_micro(batch, k: int):
    """Every leaf (B, ...) -> (k, B/k, ...), by the spec's interleaved rule."""
    return jax.tree.map(lambda x: interleaved_micro_batches(x, k), batch)


def cast_floats(tree, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


@dataclasses.dataclass(frozen=True)
class Precision:
    compute: Any = jnp.float32
    grad_reduce: Any = jnp.float32


LOSS_FN_RETURNS = ("loss_fn(params, batch) must return (loss_sum, valid_tokens, aux): the sum of "
                   "per-token losses as a scalar array, the count of valid tokens as a scalar "
                   "array or a Python number, aux a pytree (or {})")


def _kind(value) -> str:
    """What a returned value is, as the error shows it: `float32[8,5]`, `int`, `tuple of 2`."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        return f"{value.dtype}[{','.join(map(str, np.shape(value)))}]"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def loss_parts(returned):
    """`loss_fn`'s return checked at trace time: a wrong one is one line saying what was
    expected and what came back (a bare mean, a per-token array), not an error from deep in
    the accumulation. A Python count (`batch["y"].size`) is taken as torch's wrap takes it, a
    constant of the trace."""
    if not isinstance(returned, (tuple, list)) or len(returned) != 3:
        raise UserInputError(f"{LOSS_FN_RETURNS}; it returned {_kind(returned)}")
    loss_sum, tokens, aux = returned
    if isinstance(tokens, (int, float)) and not isinstance(tokens, bool):
        tokens = jnp.float32(tokens)
    for name, value in (("loss_sum", loss_sum), ("valid_tokens", tokens)):
        if not isinstance(value, (jax.Array, np.ndarray, np.generic)) or np.shape(value) != ():
            raise UserInputError(f"{LOSS_FN_RETURNS}; its {name} is {_kind(value)}")
    if not jnp.issubdtype(loss_sum.dtype, jnp.floating):
        raise UserInputError(f"{LOSS_FN_RETURNS}; its loss_sum is {_kind(loss_sum)}")
    return loss_sum, tokens, aux


def accumulate(loss_fn, params, micro_batches, precision: Precision,
                micro_constraint: Callable = lambda b: b, micro_gns: bool = False):
    """Sums over micro-batches: (gradient of the loss sum, loss sum, valid tokens, aux), and
    with `micro_gns` also the sum of each micro-batch's |mean gradient|^2 (metrics.gns)."""

    def grads_of(params, batch):
        def loss(p):
            loss_sum, tokens, aux = loss_parts(loss_fn(cast_floats(p, precision.compute), batch))
            return loss_sum.astype(jnp.float32), (tokens.astype(jnp.float32), aux)

        (loss_sum, (tokens, aux)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        sums = (cast_floats(grads, precision.grad_reduce), loss_sum, tokens, aux)
        return (*sums, gns.mean_sq(grads, tokens)) if micro_gns else sums

    def body(carry, batch):
        return jax.tree.map(jnp.add, carry, grads_of(params, micro_constraint(batch))), None

    first = jax.tree.map(lambda x: x[0], micro_batches)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grads_of, params, first))
    sums, _ = jax.lax.scan(body, zeros, micro_batches)
    return sums


def apply_update(state, grad_sum, loss_sum, tokens, aux):
    """Divide once by the total valid tokens, then update: the token-weighted rule of
    trainspec.core.accumulation (`token_weighted` is its float64 reference)."""
    denom = jnp.maximum(tokens, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grad_sum, state.params)
    new_state = state.apply_gradients(grads=grads)
    metrics = {
        "loss": loss_sum / denom,
        "valid_tokens": tokens,
        "grad_norm": optax.tree.norm(grads),
        **({"aux": aux} if jax.tree.leaves(aux) else {}),
    }
    return new_state, metrics


def accumulated_step(loss_fn, state, micro_batches, precision: Precision | None,
                      micro_constraint: Callable = lambda b: b, micro_gns: bool = False):
    """One step over global arrays: XLA inserts (and schedules) the cross-replica reductions.
    With `micro_gns`, the micro-batches are GNS's small batches (one replica)."""
    sums = accumulate(loss_fn, state.params, micro_batches, precision or Precision(),
                       micro_constraint, micro_gns)
    new_state, metrics = apply_update(state, *sums[:4])
    if micro_gns:
        k = jax.tree.leaves(micro_batches)[0].shape[0]
        metrics.update(gns.micro_parts(sums[4], k, sums[0], sums[2]))
    return new_state, metrics
