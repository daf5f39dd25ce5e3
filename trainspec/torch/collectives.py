"""The six collectives on torch.distributed, with the spec's semantics (docs/adapters.md).

A `Group` is one collective's members in the spec's rank order (row-major over the axes
tuple, in the tuple's order). torch.distributed numbers a group's members by sorted global
rank, which differs when the axes are not in mesh order, so results are put back in the
spec's order here. Where gloo differs from the spec (measured with torch 2.13 on CPU; the
numbers are in docs/adapters.md), the adapter fixes it:
- 16-bit floating sums: gloo adds in the 16-bit type (bfloat16 256 + 1 + 1 + 1 over 4 ranks
  gives 256 for some elements, 260 for others); the spec requires a float32 accumulator, so
  bfloat16/float16 operands are reduced in float32 and rounded once;
- max/min: gloo drops a NaN (max(1, NaN) = 1); the spec's max/min propagate it, so a NaN flag
  is reduced beside the values and NaN restored where any member had one;
- `mean`: the (widened) sum divided by the group size, so a 16-bit mean rounds once; an
  integer mean is refused, as everywhere, instead of silently changing the dtype; `prod`,
  which gloo has, is refused because the spec has no such op;
- permute: point-to-point send/recv between the named pairs; members that receive nothing
  get zeros.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from trainspec.core.collective_calls import check_call

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
              "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclasses.dataclass(frozen=True)
class Group:
    ranks: tuple[int, ...]  # global ranks in the spec's member order
    handle: object          # the torch.distributed process group

    @property
    def n(self) -> int:
        return len(self.ranks)

    def member(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    def by_torch_order(self, items: list) -> list:
        """`items` indexed by torch's group rank (sorted global ranks) -> spec member order."""
        order = sorted(self.ranks)
        return [items[order.index(r)] for r in self.ranks]

    def to_torch_order(self, items: list) -> list:
        """`items` in spec member order -> indexed by torch's group rank."""
        return [items[self.ranks.index(r)] for r in sorted(self.ranks)]


def call(group: Group, collective: str, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """Run `collective` on this member's block `x` (validated first, as every implementation
    does)."""
    dtype = str(x.dtype).removeprefix("torch.")
    kw = check_call(collective, tuple(x.shape), dtype, x.is_floating_point(), group.n,
                    group.ranks, kwargs)
    return OPS[collective](group, x, **kw)


def _widened(x):
    return x.float() if x.dtype in SIXTEEN_BIT else x.clone()


def all_reduce(group: Group, x, op="sum"):
    wide = _widened(x)
    dist.all_reduce(wide, REDUCE_OPS[op], group=group.handle)
    if op in ("max", "min") and x.is_floating_point():
        nan = x.isnan().to(torch.uint8)
        dist.all_reduce(nan, dist.ReduceOp.MAX, group=group.handle)
        wide = wide.masked_fill(nan.bool(), float("nan"))
    if op == "mean":
        wide = wide / group.n
    return wide.to(x.dtype)


def reduce_scatter(group: Group, x, scatter_dimension=0, op="sum"):
    wide = _widened(x)
    blocks = [b.contiguous() for b in wide.chunk(group.n, dim=scatter_dimension)]
    out = torch.empty_like(blocks[0])
    dist.reduce_scatter(out, group.to_torch_order(blocks), group=group.handle)
    if op == "mean":
        out = out / group.n
    return out.to(x.dtype)


def all_gather(group: Group, x, axis=0):
    parts = [torch.empty_like(x) for _ in range(group.n)]
    dist.all_gather(parts, x.contiguous(), group=group.handle)
    return torch.cat(group.by_torch_order(parts), dim=axis)


def all_to_all(group: Group, x, split_axis, concat_axis):
    blocks = [b.contiguous() for b in x.chunk(group.n, dim=split_axis)]
    received = [torch.empty_like(b) for b in blocks]
    dist.all_to_all(received, group.to_torch_order(blocks), group=group.handle)
    return torch.cat(group.by_torch_order(received), dim=concat_axis)


def broadcast(group: Group, x, root=0):
    out = x.clone()
    dist.broadcast(out, src=group.ranks[root], group=group.handle)
    return out


def permute(group: Group, x, perm):
    me = group.member(dist.get_rank())
    out = torch.zeros_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), group.ranks[d], group.handle)
           for s, d in perm if s == me]
    ops += [dist.P2POp(dist.irecv, out, group.ranks[s], group.handle) for s, d in perm if d == me]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return out


OPS = {f.__name__: f for f in (all_reduce, reduce_scatter, all_gather, all_to_all, broadcast,
                               permute)}
