"""Where the reference model's state lives: each parameter's share of one device under a
layout (the mesh's `ParallelDims`), as trainspec.jax.layout places them (the same logical rules,
an uneven split replicated, ZeRO-1's extra split of the optimizer state over the data axes),
and with a pipeline, on one stage (`Stage`: its layers, the embedding on the first stage, the
final norm and head on the last)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from trainspec.core.layout_rules import dim_axes, logical_rules
from trainspec.core.mesh import ParallelDims
from trainspec.core.pipeline.stages import chunk_layers, stage_of_chunk
from trainspec.core.plan.transformer import Param, parameters
from trainspec.core.spec import Spec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4}


@dataclasses.dataclass(frozen=True)
class Stage:
    """The part of the model one pipeline stage holds."""

    index: int
    layers: frozenset[int]
    first: bool
    last: bool

    def holds(self, p: Param) -> bool:
        if p.layer is not None:
            return p.layer in self.layers
        return self.first if p.path == "embedding" else self.last  # final norm and head


def pipeline_stages(spec: Spec, stages: int) -> list[Stage]:
    """Every stage's layers under the spec's `[pipeline]` section (trainspec.core.pipeline)."""
    v = spec.pipeline.virtual_stages
    chunks = chunk_layers(spec.model.n_layers, stages * v, spec.pipeline.layers_per_stage)
    held: list[set[int]] = [set() for _ in range(stages)]
    for k, layers in enumerate(chunks):
        held[stage_of_chunk(k, stages)].update(layers)
    return [Stage(s, frozenset(held[s]), s == 0, s == stages - 1) for s in range(stages)]


@dataclasses.dataclass(frozen=True)
class Share:
    """One parameter on one device: its elements there, and the mesh axes that split it."""

    param: Param
    elements: int
    axes: frozenset[str]


def shares(spec: Spec, layout: ParallelDims, skip: tuple[str, ...] = (),
           stage: Stage | None = None) -> Iterator[Share]:
    """Every parameter's share of one device (of `stage`'s parameters, when given), with the
    mesh axes in `skip` treated as size 1 (skip the fsdp axes: the share a device holds once
    fsdp has gathered it)."""
    rules = logical_rules(spec)
    shape = {a: (1 if a in skip else s) for a, s in layout.shape.items()}
    for p in parameters(spec.model):
        if stage is not None and not stage.holds(p):
            continue
        used: set[str] = set()
        split = 1
        for dim, logical in zip(p.shape, p.logical):
            split *= math.prod(shape[a] for a in dim_axes(rules, logical, dim, shape, used))
        yield Share(p, p.size // split, frozenset(used))


def local_elements(spec: Spec, layout: ParallelDims, skip: tuple[str, ...] = (),
                   stage: Stage | None = None) -> int:
    return sum(s.elements for s in shares(spec, layout, skip, stage))


def data_split_shares(spec: Spec, layout: ParallelDims, stage: Stage | None = None) -> list[Share]:
    """The parameters whose optimizer state ZeRO-1 (`layout.optimizer_state =
    "shard_over_data"`) also splits over the free data axes: those with a dimension no rule
    splits that the data axes divide evenly (trainspec.jax.layout). Each is updated on its
    slice and all-gathered back over those axes."""
    if spec.layout.optimizer_state != "shard_over_data":
        return []
    rules = logical_rules(spec)
    data = layout.split("data")
    out = []
    for share in shares(spec, layout, stage=stage):
        n = math.prod(layout.shape[a] for a in data if a not in share.axes)
        if n > 1 and any(not any(a in share.axes for a in rules.get(lg, ())) and dim % n == 0
                         for dim, lg in zip(share.param.shape, share.param.logical)):
            out.append(share)
    return out


def optimizer_elements(spec: Spec, layout: ParallelDims, stage: Stage | None = None) -> float:
    """Optimizer-state elements per device per copy: like the parameter, less what ZeRO-1
    splits over the free data axes."""
    data = layout.split("data")
    split = {s.param.path: math.prod(layout.shape[a] for a in data if a not in s.axes)
             for s in data_split_shares(spec, layout, stage)}
    return sum(s.elements / split.get(s.param.path, 1) for s in shares(spec, layout, stage=stage))
