"""The layout the torch implementation gives a model under a spec, worked out without starting
ranks (`trainspec validate --framework torch`): for each parameter, which mesh axes split which
of its dimensions and the block rank 0 holds, as trainspec.torch.wrap will lay it out.

The same rules as trainspec/torch/layout.py, read instead of applied: the tensor plan splits a
ColwiseParallel layer's weight and bias on their dimension 0 and a RowwiseParallel layer's
weight on dimension 1 (its bias is replicated); FSDP2 then splits every parameter on dimension 0
over the fsdp axis, in torch.chunk's blocks (rank 0's is the largest).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from trainspec.core.mesh import ParallelDims
from trainspec.torch.layout import default_tensor_plan, shard_units

# (parameter's last name, style) -> the dimension the tensor axis splits
_TENSOR_DIMS = {("weight", "ColwiseParallel"): 0, ("bias", "ColwiseParallel"): 0,
                ("weight", "RowwiseParallel"): 1}


def parameter_layout(dims: ParallelDims, model: nn.Module,
                     fsdp_units: Sequence[str] | None = None,
                     tensor_plan: dict | None = None) -> list[tuple[str, tuple, dict, tuple]]:
    """[(name, full shape, {mesh axis: split dimension}, rank 0's local shape)] for each of
    `model`'s parameters on the mesh `dims` (trainspec.torch.support.check_layout's), in
    `named_parameters` order; the module-name rules refused as `wrap` refuses them."""
    sizes = dims.shape
    fsdp, tensor = dims.split("fsdp"), dims.split("tensor")
    shard_units(model, fsdp_units)  # its rules are checked whatever the mesh
    styles = {}
    if tensor:
        plan = tensor_plan or default_tensor_plan(model, sizes[tensor[0]])
        styles = {name: type(style).__name__ for name, style in plan.items()}
    rows = []
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        splits, local = {}, list(param.shape)
        dim = _TENSOR_DIMS.get((leaf, styles.get(module)))
        if dim is not None:
            splits[tensor[0]] = dim
            local[dim] //= sizes[tensor[0]]
        if fsdp and local:
            splits[fsdp[0]] = 0
            local[0] = -(-local[0] // sizes[fsdp[0]])
        rows.append((name, tuple(param.shape), splits, tuple(local)))
    return rows


def describe(rows) -> list[str]:
    """One aligned line per parameter of `parameter_layout`."""
    def split(splits: dict) -> str:
        return ", ".join(f"dim {d} over {axis}" for axis, d in splits.items()) or "replicated"

    width = max((len(name) for name, *_ in rows), default=0)
    return [f"{name:<{width}}  {str(shape):<16} {split(splits):<36} rank 0 holds {local}"
            for name, shape, splits, local in rows]
