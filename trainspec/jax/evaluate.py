"""The eval loss of a wrapped loss step (`[eval]`, trainspec.core.evaluation): `loss_fn`'s
forward pass only, micro-batch by micro-batch as the step accumulates, on the step's batch
sharding and compute precision; no gradient, no update."""
from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp

from trainspec.core.errors import UserInputError
from trainspec.jax.step import WrappedStep
from trainspec.jax.step_forms import LossStep, cast_floats, loss_parts, split_micro

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per wrapped step


def eval_sums(wrapped, state, batch) -> tuple[float, float]:
    """(loss sum, valid tokens) of `loss_fn` over the whole global batch (each process passes
    its rows), the same on every process."""
    if not (isinstance(wrapped, WrappedStep) and isinstance(wrapped.step_fn, LossStep)):
        raise UserInputError("eval.interval: evaluating needs a synchronous step built with "
                             "trainspec.jax.loss_step(loss_fn); set eval.interval = 0")
    if wrapped not in _COMPILED:
        _COMPILED[wrapped] = jax.jit(_sums_fn(wrapped))
    with wrapped.context():
        loss_sum, tokens = _COMPILED[wrapped](state.params, wrapped.shard_batch(batch))
    return float(loss_sum), float(tokens)


def _sums_fn(wrapped: WrappedStep):
    loss_fn, compute = wrapped.step_fn.loss_fn, jnp.dtype(wrapped.spec.precision.compute)
    k = wrapped.spec.batch.accumulation_steps

    def sums(params, batch):
        def body(carry, micro):
            loss_sum, tokens, _ = loss_parts(loss_fn(cast_floats(params, compute), micro))
            return (carry[0] + loss_sum.astype(jnp.float32),
                    carry[1] + tokens.astype(jnp.float32)), None

        zero = jnp.zeros((), jnp.float32)
        return jax.lax.scan(body, (zero, zero), split_micro(batch, k))[0]

    return sums
