"""The functions of the steps trainspec sees into (trainspec.jax.step_forms), as the wrapped step
(trainspec.jax.step.WrappedStep) runs them: a loss step accumulated in one program, in which XLA
reduces the gradients across replicas; or per replica (a vmap bound to the data axes) with the
cross-replica sum made explicit through the spec's collectives backend; and a grad step per
replica for GNS over replicas.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from trainspec.jax import layout
from trainspec.jax.metrics import gns
from trainspec.jax.step_forms import (
    Precision, accumulate, accumulated_step, apply_update, split_micro,
)


def loss_step_fn(wrapped, batch_shardings):
    """The LossStep's function: accumulated in one program where XLA reduces across replicas,
    else per replica with the cross-replica sum explicit (`replica_reduced_step_fn`)."""
    spec, k = wrapped.spec, wrapped.spec.batch.accumulation_steps
    precision = Precision(jnp.dtype(spec.precision.compute), jnp.dtype(spec.precision.grad_reduce))
    # Reduce across replicas once per step, explicitly, when accumulating (a replicated
    # accumulator makes XLA all-reduce every micro-batch's gradient: k times the traffic)
    # or when the spec names a collectives backend other than XLA's own.
    # GNS over replicas needs each replica's gradient before the reduction, too.
    # A pipelined loss is a shard_map over the pipeline axis, which cannot run inside that
    # per-replica vmap: XLA reduces its gradients (the capability table refuses compression
    # and custom-call backends with a split pipeline axis).
    if wrapped.data_axes and not wrapped.pipelined and (
            k > 1 or not wrapped.backend.native or wrapped.gns_source == gns.REPLICAS
            or wrapped.compressed):
        return replica_reduced_step_fn(wrapped, precision)

    def constrain(micro):  # keep each micro-batch split over the batch shards
        return jax.tree.map(jax.lax.with_sharding_constraint, micro, batch_shardings)

    def step(state, batch):
        return accumulated_step(wrapped.step_fn.loss_fn, state, split_micro(batch, k),
                                 precision, constrain, wrapped.gns_source == gns.MICRO_BATCHES)

    return step


def grad_step_fn(wrapped):
    """A GradStep with GNS over replicas: `grad_fn` per replica (vmap bound to the data
    axes, as in the loss-step path), the replica means averaged by one explicit all-reduce,
    then `update_fn`. B is counted in rows (the unit grad_fn averages over)."""
    data, n = wrapped.data_axes, wrapped.replicas
    inner_rules = layout.flax_rules(wrapped.spec, without=data)

    def step(state, batch):
        per_replica = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)
        with nn.logical_axis_rules(inner_rules):
            grads, metrics = jax.vmap(wrapped.step_fn.grad_fn, in_axes=(None, 0),
                                      spmd_axis_name=data)(state.params, per_replica)
        mean = jax.tree.map(lambda g: g / n, wrapped._reduce_over_replicas(grads))
        rows = jax.tree.leaves(batch)[0].shape[0]
        metrics = {
            **jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics),
            "grad_norm": optax.tree.norm(mean),
            **gns.step_parts(jnp.mean(gns.stacked_sq_norms(grads)), rows / n,
                             gns.sq_norm(mean), rows),
        }
        return wrapped.step_fn.update_fn(state, mean), metrics

    return step


def replica_reduced_step_fn(wrapped, precision: Precision):
    """The step with the cross-replica gradient sum made explicit: once per step, through
    the spec's collectives backend (`collectives.backend`: lax, or the xla_ext custom calls).

    Each data-parallel replica's sums are computed by `vmap` over a leading replica axis
    (bound to the data mesh axes, so each replica stays on its own devices and the model
    code is unchanged; fsdp/tensor axes inside a replica stay with XLA). The per-replica
    gradient sums are then all-reduced over the data axes in a `shard_map`. Tokens and loss
    sums are scalars: summed over the replica axis directly.
    """
    spec, mesh, data = wrapped.spec, wrapped.mesh, wrapped.data_axes
    k, n = spec.batch.accumulation_steps, wrapped.replicas
    inner_rules = layout.flax_rules(spec, without=data)
    inner_batch_spec = lambda x: NamedSharding(  # noqa: E731
        mesh, layout.batch_partition_spec(spec, mesh, np.ndim(x), without=data))
    reduce_over_replicas = wrapped._reduce_over_replicas

    def step(state, batch):
        def replica_sums(rows):
            micro = split_micro(rows, k)
            constrain = lambda b: jax.tree.map(  # noqa: E731
                lambda x: jax.lax.with_sharding_constraint(x, inner_batch_spec(x)), b)
            return accumulate(wrapped.step_fn.loss_fn, state.params, micro, precision, constrain)

        # Rows of replica r are its contiguous block of the data-sharded batch dimension.
        per_replica = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)
        with nn.logical_axis_rules(inner_rules):
            grad_sums, loss_sums, token_sums, aux = jax.vmap(
                replica_sums, spmd_axis_name=data)(per_replica)
        if wrapped.error_feedback:
            grad_sum, residual = reduce_over_replicas(grad_sums, state.ef_residual)
        else:
            grad_sum = reduce_over_replicas(grad_sums)
        total = lambda t: jax.tree.map(lambda x: jnp.sum(x, axis=0), t)  # noqa: E731
        new_state, metrics = apply_update(state, grad_sum, total(loss_sums), total(token_sums),
                                    total(aux))
        if wrapped.error_feedback:
            new_state = new_state.replace(ef_residual=residual)
        if wrapped.gns_source == gns.REPLICAS:
            metrics.update(gns.replica_parts(grad_sums, token_sums, grad_sum,
                                             total(token_sums)))
        return new_state, metrics

    return step
