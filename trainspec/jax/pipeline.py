"""A model's stack of identical blocks run as a pipeline over the mesh's `pipeline` axis inside
the wrapped step, in the order of the core's schedule (docs/pipeline.md).

A model names its stage boundaries with `Stages`: what runs before the blocks (`embed`), one
block (`block`), the blocks' parameter names in order, and what runs after them with the loss
(`head_loss`). `pipelined(stages, spec, n, axis)` gives the loss_fn that `loss_step` takes.

The loss of one accumulation micro-batch splits it into m pipeline micro-batches (micro-batch
i holds rows i, i+m, ...: docs/spec.md). The embedding runs before the pipeline, split over the
batch axes. The pipeline is one `shard_map` manual over the pipeline and data axes (the fsdp
and tensor axes stay XLA's; each data replica sums its gradients over the whole schedule and
the replicas' sums are added once after it): a scan over the ticks of the executed schedule
(trainspec.core.pipeline.ticks), in which each stage runs the operation its row says, by a
`lax.switch` on its own stage index, so each device computes only its own operation. Then the
activations move one stage on and the cotangents one stage back (two permutes every tick,
through the spec's collectives backend; what carries nothing lands in a buffer's trash slot).
A stage keeps the input of each
micro-batch in flight and recomputes its forward inside the backward (`jax.vjp`), so a
schedule's activation memory is its buffer: m inputs under GPipe, at most p under 1F1B. The
last chunk's forward runs inside its backward together with the head and the loss.

Gradients are computed by the schedule, not by autodiff of it: a `custom_vjp` whose forward
runs the whole schedule and returns the loss sum with the gradients as residuals, scaled by the
loss sum's cotangent in the backward. The step's token-weighted accumulation is unchanged.

The wrapped step holds the blocks' parameters and their optimizer state by stage
(trainspec.jax.pipeline_params): stage s holds its own chunks only, and their gradients come out
of the schedule where they are held. Checkpoints keep one leaf per block, for any stage count.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from trainspec.core.errors import UserInputError
from trainspec.core.mesh import ParallelDims
from trainspec.core.pipeline import schedule as core_schedule
from trainspec.core.pipeline.stages import INTERLEAVED
from trainspec.core.pipeline.ticks import BACKWARD_KIND, FORWARD_KIND, Ticks, tables
from trainspec.core.spec import Spec
from trainspec.jax import collectives
from trainspec.jax.layout import flax_rules
from trainspec.jax.pipeline_params import Staged, StageForm
from trainspec.jax.models.transformer import (
    Transformer, as_logits, block_class, embed, final_norm, head, next_token_loss)
from trainspec.jax.step_forms import LossStep


@dataclasses.dataclass(frozen=True)
class Stages:
    """Where a model's pipeline stages begin and end (docs/wrapping.md, "Pipeline").

    `embed(params, batch) -> x`: everything before the blocks, x of shape (rows, ...), from
    the parameters other than the blocks';
    `block(block_params, x) -> x`: one block, the same function for every block;
    `blocks`: the top-level keys of `params` holding the blocks' parameters, in order;
    `head_loss(params, y, batch) -> (loss_sum, valid_tokens)`: everything after the blocks,
    on one pipeline micro-batch's rows of every batch leaf."""

    embed: Callable[[Any, Any], jax.Array]
    block: Callable[[Any, jax.Array], jax.Array]
    blocks: Sequence[str]
    head_loss: Callable[[Any, jax.Array, Any], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class PipelinedLoss:
    """loss_fn(params, batch) -> (loss_sum, valid_tokens, {}) of a model run as a pipeline of
    `stages` stages. The wrapped step recognises it: a split pipeline axis needs one."""

    fn: Callable
    schedule: str
    stages: int
    microbatches: int
    virtual: int
    ticks: Ticks  # what each stage runs at each tick: the executed schedule
    form: StageForm  # the blocks' parameters held by stage in the wrapped step's state

    def __call__(self, params, batch):
        return self.fn(params, batch)


def pipelined_loss_of(step_fn, dims: ParallelDims) -> PipelinedLoss | None:
    """The step's pipelined loss, checked against the mesh's pipeline axis. A split pipeline
    axis needs one: any other step would run every layer on every stage, replicated."""
    loss = step_fn.loss_fn if isinstance(step_fn, LossStep) else None
    axes = dims.split("pipeline")
    if not isinstance(loss, PipelinedLoss):
        if axes:
            raise UserInputError(
                f"mesh.axes.{axes[0]}.size: {dims.stages} pipeline stages need a loss built "
                "with trainspec.jax.pipelined (the model's stage boundaries: docs/wrapping.md); "
                "this step would run every layer on every stage. Set it to 1, or build the "
                "loss with trainspec.jax.pipelined")
        return None
    if loss.stages != dims.stages:
        raise UserInputError(
            f"mesh.axes.{(dims.axes_with_role('pipeline') or ('pipeline',))[0]}.size: the loss "
            f"was built by trainspec.jax.pipelined for {loss.stages} stages, the mesh has "
            f"{dims.stages}")
    return loss


def _microbatched(tree, m: int):
    """Every leaf (rows, ...) -> (m, rows / m, ...), micro-batch i holding rows i, i+m, ..."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1),
                        tree)


def _run_schedule(stages: Stages, ticks: Ticks, axis: str, data: tuple[str, ...], p: int,
                  v: int, inner_rules: list):
    """(chunks, rest, xs, micro) -> (loss_sum, tokens, d chunks, d rest, d xs): the schedule
    run as one shard_map over `axis` and the `data` axes. Manual over the data axes, each
    replica sums its own gradients over the ticks and they are summed over the replicas once,
    after the schedule: left to XLA, every backward tick all-reduced its block's gradient.
    Inside, the model's activation constraints follow `inner_rules` (none over `data`)."""
    last = p * v - 1
    table = np.stack([np.asarray(getattr(ticks, name), np.int32) for name in (
        "kind", "microbatch", "chunk", "input_slot", "gradient_slot", "receive_activation",
        "receive_gradient")], axis=-1)  # [tick, stage, field]

    def run_chunk(chunk_params, x):
        def one(x, block_params):
            return stages.block(block_params, x), None
        return jax.lax.scan(one, x, chunk_params)[0]

    def body(chunks, rest, xs, micro, table):
        s = jax.lax.axis_index(axis)
        chunks = jax.tree.map(lambda a: a[0], chunks)  # this stage's [v, layers, ...]
        zeros = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
        # the gradients summed over micro-batches in float32, whatever precision.compute is
        float32 = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t)  # noqa: E731
        buffer = lambda n: jnp.zeros((n + 1, *xs.shape[1:]), xs.dtype)  # noqa: E731

        def tick(carry, row):
            acts, grads, d_chunks, d_rest, d_xs, loss, tokens = carry
            kind, i, c, in_slot, g_slot, recv_act, recv_grad = (row[s, f] for f in range(7))
            k = c * p + s
            x = jnp.where(k == 0, _at(xs, i), _at(acts, in_slot))
            params_c = jax.tree.map(lambda a: _at(a, c), chunks)
            mb = jax.tree.map(lambda a: _at(a, i), micro)

            def idle(_):
                return jnp.zeros_like(x), jnp.zeros_like(x), d_chunks, d_rest, loss, tokens

            def forward(_):
                return run_chunk(params_c, x), jnp.zeros_like(x), d_chunks, d_rest, loss, tokens

            def backward(_):
                _, vjp = jax.vjp(run_chunk, params_c, x)
                d_params, dx = vjp(_at(grads, g_slot))
                return (jnp.zeros_like(x), dx, _added(d_chunks, c, d_params), d_rest, loss,
                        tokens)

            def last_backward(_):
                def chunk_loss(params_c, rest, x):
                    return stages.head_loss(rest, run_chunk(params_c, x), mb)
                (loss_i, tokens_i), vjp = jax.vjp(chunk_loss, params_c, rest, x)
                d_params, d_r, dx = vjp((jnp.ones_like(loss_i), jnp.zeros_like(tokens_i)))
                return (jnp.zeros_like(x), dx, _added(d_chunks, c, d_params),
                        jax.tree.map(jnp.add, d_rest, d_r), loss + loss_i,
                        tokens + tokens_i.astype(tokens.dtype))

            # the last chunk's forward runs inside its backward, with the head and the loss
            branch = jnp.where(kind == FORWARD_KIND, jnp.where(k == last, 0, 1),
                               jnp.where(kind == BACKWARD_KIND, jnp.where(k == last, 3, 2), 0))
            y, dx, d_chunks, d_rest, loss, tokens = jax.lax.switch(
                branch, (idle, forward, backward, last_backward), None)
            d_xs = _add_at(d_xs, i, jnp.where((kind == BACKWARD_KIND) & (k == 0), dx, 0))
            # through the spec's collectives backend (xla's ppermute, or ext's custom call)
            y = collectives.permute(y, axis, [(a, (a + 1) % p) for a in range(p)])
            dx = collectives.permute(dx, axis, [(a, (a - 1) % p) for a in range(p)])
            acts = jax.lax.dynamic_update_index_in_dim(acts, y, recv_act, 0)
            grads = jax.lax.dynamic_update_index_in_dim(grads, dx, recv_grad, 0)
            return (acts, grads, d_chunks, d_rest, d_xs, loss, tokens), None

        start = (buffer(ticks.activation_slots), buffer(ticks.gradient_slots), float32(chunks),
                 float32(rest), zeros(xs), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (_, _, d_chunks, d_rest, d_xs, loss, tokens), _ = jax.lax.scan(tick, start, table)
        # only one stage's loss, rest and input gradients are nonzero; each replica's its own
        replicas = tuple(a for a in data if jax.lax.axis_size(a) > 1)

        def summed(tree, axes):
            return jax.tree.map(lambda a: collectives.all_reduce(a, axes) if axes else a, tree)

        # every output once all are made: an XLA collective that reads one of them (the
        # embedding's gradient over data) must not run beside ext's blocking custom calls
        return jax.lax.optimization_barrier((
            summed(loss, (axis, *replicas)), summed(tokens, (axis, *replicas)),
            jax.tree.map(lambda a: a[None], summed(d_chunks, replicas)),
            summed(d_rest, (axis, *replicas)), summed(d_xs, (axis,))))

    rows = P(None, data)  # [micro-batch, its rows, ...]: the rows split over the replicas

    def constrained(*args):
        with nn.logical_axis_rules(inner_rules):
            return body(*args)

    def run(chunks, rest, xs, micro):
        loss, tokens, d_chunks, d_rest, d_xs = jax.shard_map(
            constrained, in_specs=(P(axis), P(), rows, rows, P()),
            # check_vma off: every value inside varies over the axis (each stage's own switch)
            out_specs=(P(), P(), P(axis), P(), rows), axis_names={axis, *data}, check_vma=False,
        )(chunks, rest, xs, micro, jnp.asarray(table))
        like = lambda grads, primals: jax.tree.map(  # noqa: E731  the dtypes autodiff expects
            lambda g, a: g.astype(a.dtype), grads, primals)
        return loss, tokens, like(d_chunks, chunks), like(d_rest, rest), d_xs

    return run


# Indexing by a traced position as dynamic slices, not gathers and scatters: inside the
# shard_map beside a split tensor axis, XLA's SPMD partitioner failed a check on a gather.
def _at(a, position):
    return jax.lax.dynamic_index_in_dim(a, position, 0, keepdims=False)


def _add_at(a, position, update):
    return jax.lax.dynamic_update_index_in_dim(a, _at(a, position) + update.astype(a.dtype),
                                               position, 0)


def _added(tree, c, update):
    return jax.tree.map(lambda a, u: _add_at(a, c, u), tree, update)


def pipelined(stages: Stages, spec: Spec, n_stages: int, axis: str) -> PipelinedLoss:
    """The loss_fn of the model `stages` describes, its blocks run as a pipeline of
    `n_stages` stages over mesh axis `axis` under the spec's `[pipeline]` schedule."""
    section, p = spec.pipeline, n_stages
    v = section.virtual_stages if section.schedule == INTERLEAVED else 1
    m = section.microbatches or p
    chunks = p * v
    counts = list(section.layers_per_stage) or [len(stages.blocks) // chunks] * chunks
    if len(counts) != chunks or sum(counts) != len(stages.blocks) or len(set(counts)) != 1:
        raise UserInputError(
            f"Stages.blocks: {len(stages.blocks)} blocks do not split into {chunks} equal "
            f"chunks of {counts} ({p} stages x {v} virtual stages): each stage's blocks are "
            "stacked")
    ticks = tables(core_schedule.run(section.schedule, p, m, v))
    data = spec.mesh.axes_with_role("data")
    run = _run_schedule(stages, ticks, axis, data, p, v, flax_rules(spec, without=data))

    @jax.custom_vjp
    def through_pipeline(chunks, rest, xs, micro):
        return run(chunks, rest, xs, micro)[:2]

    def forward(chunks, rest, xs, micro):
        loss, tokens, *grads = run(chunks, rest, xs, micro)
        return (loss, tokens), grads

    def backward(grads, cotangents):
        scale = lambda t: jax.tree.map(lambda g: (g * cotangents[0]).astype(g.dtype), t)  # noqa: E731
        return (*map(scale, grads), None)

    through_pipeline.defvjp(forward, backward)

    form = StageForm(tuple(stages.blocks), p, v, axis)

    def loss_fn(params, batch):
        # the model's own tree (the loss called outside a wrapped step) is staged here
        held = params if isinstance(params, Staged) else form.staged(params)
        xs = _microbatched(stages.embed(held.rest, batch), m)
        loss_sum, tokens = through_pipeline(held.stages, held.rest, xs, _microbatched(batch, m))
        return loss_sum, tokens, {}

    return PipelinedLoss(loss_fn, section.schedule, p, m, v, ticks, form)


def transformer_stages(model: Transformer) -> Stages:
    """The reference transformer's stages: the embedding, its blocks, the norm and head."""
    c, dtype, param_dtype = model.config, model.dtype, model.param_dtype
    block = block_class(model.remat)(c, dtype, param_dtype, model.attention)

    def head_loss(params, y, batch):
        y = final_norm(dtype, param_dtype).apply({"params": params["final_norm"]}, y)
        logits = as_logits(head(c, dtype, param_dtype).apply({"params": params["head"]}, y))
        return next_token_loss(logits, batch["targets"], batch["mask"], one_hot=True)

    return Stages(
        embed=lambda params, batch: embed(batch["inputs"], params["embedding"], c.vocab_size,
                                          dtype),
        block=lambda params, x: block.apply({"params": params}, x),
        blocks=[f"block_{i}" for i in range(c.n_layers)],
        head_loss=head_loss)


def pipelined_loss(model: Transformer, spec: Spec, n_stages: int, axis: str) -> PipelinedLoss:
    """The reference transformer's loss_fn with its blocks run as a pipeline."""
    return pipelined(transformer_stages(model), spec, n_stages, axis)
