"""Pipeline stages of the reference transformer inside the wrapped step (docs/pipeline.md).

The loss of one accumulation micro-batch runs its blocks as a pipeline over the mesh's
`pipeline` axis: the micro-batch is split into m pipeline micro-batches (micro-batch i holds
rows i, i+m, ...: docs/spec.md), and in each of m + p − 1 ticks every stage applies its layers
to what it holds (a vmap over the stage dimension, split over the pipeline axis) and passes the
result on to the next stage (a shift along that dimension, which XLA lowers to a
collective-permute). Stage s runs micro-batch t − s at tick t: the forward of the core's GPipe
schedule (trainspec.core.pipeline.schedule). The backward is its reverse, by autodiff: at the
reverse of tick t stage s runs the backward of micro-batch t − s, the last stage first, and the
cotangents travel back through the transposed shifts. The loss is the sum of the per-token
losses of all pipeline micro-batches with the count of their valid tokens, so the step's
token-weighted accumulation is unchanged.

The blocks' parameters stay one leaf per block, laid out as without a pipeline (replicated
over the pipeline axis); each stage's are stacked and constrained to its devices inside the
step, and each stage computes only its own layers. The embedding and the head are computed
before and after the pipeline, split over the batch axes like the rest of the step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trainspec.core.pipeline.stages import chunk_layers
from trainspec.core.spec import Spec
from trainspec.jax.models.transformer import (
    Transformer, as_logits, block_class, embed, final_norm, head, next_token_loss)


def _along(axis: str, x):
    """`x` split over the pipeline axis along its leading (stage) dimension."""
    return jax.lax.with_sharding_constraint(x, P(axis, *[P.UNCONSTRAINED] * (x.ndim - 1)))


def stacked_stages(params: dict, layers: list[range], axis: str):
    """The blocks' parameters as one tree of [stages, layers per stage, ...] leaves, each
    stage's slice on that stage's devices."""
    per_stage = [jax.tree.map(lambda *ls: jnp.stack(ls), *(params[f"block_{i}"] for i in rng))
                 for rng in layers]
    return jax.tree.map(lambda *ss: _along(axis, jnp.stack(ss)), *per_stage)


def pipelined_loss(model: Transformer, spec: Spec, stages: int, axis: str):
    """loss_fn(params, batch) -> (loss_sum, valid_tokens, aux) of `model` with its blocks run
    as a pipeline of `stages` stages over mesh axis `axis`."""
    c, dtype, param_dtype = model.config, model.dtype, model.param_dtype
    m = spec.pipeline.microbatches or stages
    layers = chunk_layers(c.n_layers, stages, spec.pipeline.layers_per_stage)
    block = block_class(model.remat)(c, dtype, param_dtype, model.attention)

    def run_stage(stage_params, x):
        for j in range(len(layers[0])):
            x = block.apply({"params": jax.tree.map(lambda a: a[j], stage_params)}, x)
        return x

    def loss_fn(params, batch):
        x = embed(batch["inputs"], params["embedding"], c.vocab_size, dtype)
        rows, length, width = x.shape
        # [m, rows / m, length, width]: pipeline micro-batch i holds rows i, i + m, ...
        xs = x.reshape(rows // m, m, length, width).swapaxes(0, 1)
        stacked = stacked_stages(params, layers, axis)
        held = _along(axis, jnp.zeros((stages, *xs.shape[1:]), xs.dtype))
        outputs = []
        for tick in range(m + stages - 1):
            fed = xs[tick] if tick < m else jnp.zeros_like(xs[0])
            held = _along(axis, jnp.concatenate([fed[None], held[:-1]]))
            held = jax.vmap(run_stage, spmd_axis_name=axis)(stacked, held)
            if tick >= stages - 1:
                outputs.append(held[-1])
        y = jnp.stack(outputs).swapaxes(0, 1).reshape(rows, length, width)
        y = final_norm(dtype, param_dtype).apply({"params": params["final_norm"]}, y)
        logits = as_logits(head(c, dtype, param_dtype).apply({"params": params["head"]}, y))
        loss_sum, tokens = next_token_loss(logits, batch["targets"], batch["mask"])
        return loss_sum, tokens, {}

    return loss_fn
