"""Gradient sums over the axes that split the tokens but not the data replicas: `context` (each
rank holds part of every sequence), `expert` (each rank holds part of the batch and some of
the experts), and beside an expert axis `fsdp` (whose ranks hold the experts' kernels whole:
FSDP2 sums the rest). A parameter whole on every rank of such an axis has there the gradient of that
rank's tokens only; the sum over the axis is the gradient of all of them. A parameter split
over the axis (an expert's kernels: a DTensor sharded on it) already has the gradient of every
token routed to it, through the all-to-all's backward, and is left alone.

It runs before the data all-reduce (trainspec/torch/reduction.py), so that what that sums,
compresses or measures for the noise scale is each data replica's whole gradient, as on a
mesh without these axes.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from trainspec.torch.layout import local_block, sharded_axes
from trainspec.torch.mesh import group_of
from trainspec.torch.reduction import packed


class ReplicatedSum:
    """Sums every trainable parameter's gradient over those of `axes` it is whole on."""

    def __init__(self, mesh: DeviceMesh, axes: tuple[str, ...],
                 named_params: Iterable[tuple[str, nn.Parameter]]):
        by_axes: dict[tuple[str, ...], list[nn.Parameter]] = {}
        for _, p in named_params:
            if p.requires_grad:
                split = sharded_axes(p) if isinstance(p, DTensor) else ()
                whole = tuple(a for a in axes if a not in split)
                if whole:
                    by_axes.setdefault(whole, []).append(p)
        self.sums = [(group_of(mesh, whole), params) for whole, params in by_axes.items()]

    def __call__(self) -> None:
        for group, params in self.sums:
            for p in params:
                if p.grad is None:  # no token of this rank reached it; another's may have
                    p.grad = torch.zeros_like(p)
            packed([local_block(p.grad) for p in params],
                   lambda flat: dist.all_reduce(flat, group=group))
