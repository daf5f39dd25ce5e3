"""The collectives of context and expert parallelism as autograd functions over gloo (or any
torch.distributed backend): what JAX's ppermute, all_gather and all_to_all are under
jax.grad, each backward the transpose of its forward.

- `ring_shift(x, group)`: rank i of the group receives rank i - 1's tensor (one permute around
  the ring, as `jax.lax.ppermute` with pairs (i, i + 1)); its backward sends each gradient
  the other way, to rank i - 1;
- `all_gather(x, group, dim)`: every rank's tensor concatenated along `dim` in group order;
  its backward gives each rank the sum over ranks of the gradient of its own slice (a
  reduce-scatter, here an all-to-all and a sum: gloo has no reduce-scatter);
- `all_to_all(x, group)`: chunk j of dimension 0 goes to rank j, which stacks what it receives
  in rank order; equal chunks make it its own transpose, so the backward is the same call.

Every rank of the group must call these in the same order (they are collectives).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _neighbours(group) -> tuple[int, int]:
    """(global rank of the next rank in the group, of the previous one)."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    return dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)


# Every buffer is made contiguous first: torch.empty_like keeps a view's strides, which the
# collectives (writing row-major) would scramble.

def _shift(x: torch.Tensor, group, to: int, source: int) -> torch.Tensor:
    x = x.contiguous()
    received = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, to, group),
           dist.P2POp(dist.irecv, received, source, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        after, before = _neighbours(group)
        return _shift(x, group, to=after, source=before)

    @staticmethod
    def backward(ctx, grad):
        after, before = _neighbours(ctx.group)
        return _shift(grad, ctx.group, to=before, source=after), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        chunks = torch.stack(grad.chunk(n, ctx.dim))  # chunk j: the gradient of rank j's slice
        return _exchange(chunks, ctx.group).sum(0), None, None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def ring_shift(x: torch.Tensor, group) -> torch.Tensor:
    return _RingShift.apply(x, group)


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _AllGather.apply(x, group, dim)


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    return _AllToAll.apply(x, group)
