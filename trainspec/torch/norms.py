"""Squared L2 norms of tensors laid out over a DeviceMesh: the gradient norm of the step and
the per-replica and per-micro-batch norms of the gradient noise scale (trainspec/torch/gns.py).

A rank holds local blocks: whole tensors, or DTensor shards split over some mesh axes. The
squares of the local blocks are summed per set of axes they are split over, and each set is
all-reduced over its axes once, so a replicated dimension is counted once.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from trainspec.torch.mesh import group_of
from trainspec.torch.layout import local_block, sharded_axes

Squares = dict[tuple[str, ...], torch.Tensor]


class Norms:
    """`stage_axes`: the pipeline axes, along which every rank holds other parameters (its
    stage's), so every set of squares is summed over them too."""

    def __init__(self, mesh: DeviceMesh, device: torch.device, stage_axes: tuple[str, ...] = ()):
        self.mesh, self.device, self.stage_axes = mesh, device, stage_axes
        self._groups: dict[tuple[str, ...], object] = {}

    def group(self, axes: tuple[str, ...]):
        """The process group of mesh axes `axes`, created once (every rank asks in the same
        order, as torch.distributed requires)."""
        if axes not in self._groups:
            self._groups[axes] = group_of(self.mesh, axes)
        return self._groups[axes]

    @staticmethod
    def local_squares(tensors: Sequence[torch.Tensor],
                      blocks: Iterable[torch.Tensor] | None = None) -> Squares:
        """This rank's sum of squares (float32) per set of axes the blocks are split over;
        `blocks`: other local blocks laid out as `tensors` (default: theirs). Each set's
        blocks take one multi-tensor norm (float32 whatever their dtype), whose squares are
        summed: a fixed few operations per set, not a few per tensor."""
        if blocks is None:
            blocks = [local_block(t) for t in tensors]
        by_axes: dict[tuple[str, ...], list[torch.Tensor]] = {}
        for t, block in zip(tensors, blocks):
            by_axes.setdefault(sharded_axes(t) if isinstance(t, DTensor) else (), []).append(block)
        return {axes: torch.stack(torch._foreach_norm(held, 2, dtype=torch.float32)).square().sum()
                for axes, held in by_axes.items()}

    def total(self, by_axes: Squares) -> torch.Tensor:
        """The global sum of squares: each set all-reduced over its axes, then added. Values
        may be vectors (one entry per micro-batch), reduced in one call per set."""
        total = None
        for split, square in by_axes.items():
            axes = tuple(a for a in self.mesh.mesh_dim_names
                         if a in split or a in self.stage_axes)  # in mesh order
            if axes:
                dist.all_reduce(square, group=self.group(axes))
            total = square if total is None else total + square
        return torch.zeros((), dtype=torch.float32, device=self.device) if total is None else total

    def norm(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of `tensors` (a float32 scalar on the device: nothing is read)."""
        return torch.sqrt(self.total(self.local_squares(tensors)))
