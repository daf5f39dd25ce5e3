"""Context parallelism in JAX: the sequence split over the `context` mesh axes (docs/spec.md,
`[context]`), attention across it by a ring of key/value blocks or by gathering them.

The two hooks a model uses (the reference transformer does; a user's model can):
- `split_sequence(spec, arrays)`: each (batch, length, ...) array put in the split order
  (trainspec.core.context.split_order), so that the context axes' contiguous shards are the
  ranks' chunks (zig-zag: chunks i and 2n-1-i on rank i). Every per-token computation is
  unchanged by the permutation, and a loss summed over tokens with the targets and mask
  permuted alike is the same sum.
- `attention_for(spec)`: causal attention of (batch, length, heads, head_dim) arrays in that
  order, masked by global position. Under a split context axis it runs in a `shard_map`: each
  rank keeps its queries and either passes its key/value block around the ring (a permute,
  n - 1 times) merging the partial softmaxes online, each block scored under the positions of
  the rank it came from (trainspec.core.ring_attention: held_block, merge_block), or
  all-gathers the blocks first. The permutes and the all-gather are trainspec.jax.collectives
  calls through the spec's `collectives.backend` (lax's, or the xla_ext custom calls). Without
  a split context axis it is `jax.nn.dot_product_attention`.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from trainspec.core.context import positions, split_order
from trainspec.core.ring_attention import held_block
from trainspec.core.spec import Spec
from trainspec.jax import collectives


def _context(spec: Spec) -> tuple[tuple[str, ...], int]:
    """The split context axes of the mesh set for tracing, and their size."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), 1
    axes = tuple(a for a in spec.mesh.axes_with_role("context") if mesh.shape.get(a, 1) > 1)
    return axes, int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def split_sequence(spec: Spec, arrays: dict) -> dict:
    """The arrays with their length dimension in the split order (unchanged with no split
    context axis)."""
    _, n = _context(spec)
    if n == 1:
        return arrays
    order = split_order(spec.batch.seq_len, n, spec.context.split)
    return {name: x[:, order] for name, x in arrays.items()}


def _merge(state, q, k, v, q_pos, k_pos, scale):
    """One block of the online softmax (trainspec.core.ring_attention.merge_block)."""
    m, l, o = state
    s = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.where(visible, jnp.exp(s - safe[..., None]), 0.0)
    rescale = jnp.where(jnp.isfinite(m), jnp.exp(m - safe), 0.0)
    o = o * jnp.swapaxes(rescale, 1, 2)[..., None] + jnp.einsum(
        "bhts,bshd->bthd", p, v.astype(jnp.float32))
    return m_new, l * rescale + p.sum(-1), o


def _local_attention(q, k, v, axes, n, table, ring: bool, move: dict):
    """One rank's attention: its queries against every rank's keys and values; `move`: the
    collectives' keyword arguments (backend, timeout) from the spec."""
    rank = jax.lax.axis_index(axes)
    q_pos = table[rank]
    scale = q.shape[-1] ** -0.5
    b, t, h, d = q.shape
    state = (jnp.full((b, h, t), -jnp.inf), jnp.zeros((b, h, t)), jnp.zeros((b, t, h, d)))
    if ring:
        for step in range(n):
            state = _merge(state, q, k, v, q_pos, table[held_block(rank, step, n)], scale)
            if step < n - 1:  # pass the block on: rank r receives rank r - 1's
                perm = [(i, (i + 1) % n) for i in range(n)]
                k, v = (collectives.permute(x, axes, perm, **move) for x in (k, v))
    else:
        k_all, v_all = (collectives.all_gather(x, axes, axis=1, **move) for x in (k, v))
        state = _merge(state, q, k_all, v_all, q_pos, table.reshape(-1), scale)
    m, l, o = state
    return (o / jnp.swapaxes(l, 1, 2)[..., None]).astype(q.dtype)


def attention_for(spec: Spec):
    """The causal attention function of the spec's context layout (see the module text); it
    reads the mesh set by the wrapped step (`jax.set_mesh`) when called."""
    def attention(q, k, v):
        axes, n = _context(spec)
        if n == 1:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)
        # the rules in force where the model is traced: inside the step's vmap over replicas
        # they leave out the data axes, which the vmap binds
        mesh, rules = jax.sharding.get_abstract_mesh(), dict(nn.get_logical_axis_rules())

        def split(logical: str, size: int):  # the axes that split this dimension evenly
            names = tuple(a for a in rules.get(logical) or () if mesh.shape[a] > 1
                          and a not in axes)
            return names if names and size % int(np.prod([mesh.shape[a] for a in names])) == 0 \
                else None

        spec_ = P(split("batch", q.shape[0]), axes, split("heads", q.shape[2]), None)
        table = jnp.asarray(positions(q.shape[1], n, spec.context.split))
        move = {"backend": spec.collectives.backend, "timeout_s": spec.collectives.timeout_s}
        local = lambda q, k, v: _local_attention(  # noqa: E731
            q, k, v, axes, n, table, spec.context.attention == "ring", move)
        # check_vma off: a custom-call backend's gradients are custom VJPs, opaque to the
        # varying-manual-axes check (every operand and the output are split the same way)
        return jax.shard_map(local, in_specs=(spec_,) * 3, out_specs=spec_,
                             check_vma=False)(q, k, v)

    return attention
