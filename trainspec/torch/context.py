"""Context parallelism on torch: the sequence split over the `context` mesh axes (docs/spec.md,
`[context]`), attention across it by a ring of key/value blocks or by gathering them. The
decisions are the core's, as on JAX (trainspec/jax/context.py): which positions a rank holds
(trainspec.core.context.positions: zig-zag or contiguous chunks), which block a rank holds at
each ring step (trainspec.core.ring_attention.held_block) and the online softmax that merges
them (trainspec.core.ring_attention.merge_block); only how the bytes move differs
(trainspec/torch/differentiable.py: send/recv around the ring, or one all-gather).

The two hooks (the reference model uses both; a user's model can):
- `ContextSplit.local(batch)`: this rank's tokens of each (rows, length, ...) array, in its
  local order. A per-token loss summed over them, summed over the context ranks, is the sum
  over whole sequences;
- `ContextSplit.attention(q, k, v)`: causal attention of this rank's queries, keys and values
  ((batch, heads, local length, head_dim), the layout of F.scaled_dot_product_attention) over
  the whole sequence, masked by global position.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from trainspec.core.context import positions
from trainspec.core.ring_attention import held_block
from trainspec.core.spec import Spec
from trainspec.torch.differentiable import all_gather, ring_shift
from trainspec.torch.mesh import group_of


def causal_attention(q, k, v):
    """Plain causal attention of whole sequences (no context axis)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _merge(state, q, k, v, q_pos, k_pos, scale):
    """One block of the online softmax (trainspec.core.ring_attention.merge_block), in the
    (batch, heads, length, head_dim) layout: m and l (batch, heads, queries)."""
    m, l, o = state
    s = torch.einsum("bhtd,bhsd->bhts", q.float(), k.float()) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    s = torch.where(visible, s, -torch.inf)
    m_new = torch.maximum(m, s.amax(-1))
    safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
    p = torch.where(visible, torch.exp(s - safe[..., None]), 0.0)
    rescale = torch.where(torch.isfinite(m), torch.exp(m - safe), 0.0)
    o = o * rescale[..., None] + torch.einsum("bhts,bhsd->bhtd", p, v.float())
    return m_new, l * rescale + p.sum(-1), o


class ContextSplit:
    """This rank's place on the spec's split context axes of `mesh` (`axes`, row-major)."""

    def __init__(self, spec: Spec, mesh: DeviceMesh, axes: tuple[str, ...]):
        self.group = group_of(mesh, axes)
        self.n, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.table = torch.from_numpy(positions(spec.batch.seq_len, self.n, spec.context.split))
        self.ring = spec.context.attention == "ring"

    def local(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mine = self.table[self.rank].to(next(iter(batch.values())).device)
        return {name: x[:, mine] for name, x in batch.items()}

    def attention(self, q, k, v):
        b, h, t, d = q.shape
        table = self.table.to(q.device)
        q_pos, scale = table[self.rank], d ** -0.5
        state = (q.new_full((b, h, t), -torch.inf, dtype=torch.float32),
                 q.new_zeros((b, h, t), dtype=torch.float32),
                 q.new_zeros((b, h, t, d), dtype=torch.float32))
        if self.ring:
            for step in range(self.n):
                k_pos = table[held_block(self.rank, step, self.n)]
                state = _merge(state, q, k, v, q_pos, k_pos, scale)
                if step < self.n - 1:  # pass the block on: rank r receives rank r - 1's
                    k, v = ring_shift(torch.cat([k, v], -1), self.group).split(d, -1)
        else:
            k_all, v_all = all_gather(torch.cat([k, v], -1), self.group, 2).split(d, -1)
            state = _merge(state, q, k_all, v_all, q_pos, table.reshape(-1), scale)
        _, l, o = state
        return (o / l[..., None]).to(q.dtype)
