"""A layout's pipeline on paper: each stage's layers, the bubble and the activations each stage
holds, read off the core's executed schedule (trainspec.core.pipeline.schedule), not assumed.

The planner evaluates the stages that can be the worst: the first (the embedding and the most
activations in flight), the last (the head) and the middle stage with the most layers.
"""
from __future__ import annotations

import dataclasses
import functools

from trainspec.core.mesh import ParallelDims
from trainspec.core.pipeline.schedule import GENERATED, run
from trainspec.core.pipeline.stages import problems
from trainspec.core.plan.shards import Stage, pipeline_stages
from trainspec.core.spec import Spec


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    stages: list[Stage]
    schedule: str
    microbatches: int          # m: pipeline micro-batches per accumulation micro-batch
    virtual: int
    bubble: float              # the executed schedule's idle fraction
    in_flight: list[float]     # per stage, peak activations held, in micro-batches of the stage

    def considered(self) -> list[Stage]:
        """First, last, and the middle stage with the most layers."""
        middle = sorted(self.stages[1:-1], key=lambda s: -len(s.layers))[:1]
        return [self.stages[0], *middle, self.stages[-1]]

    def as_dict(self) -> dict:
        return {"stages": len(self.stages), "schedule": self.schedule,
                "microbatches": self.microbatches, "virtual_stages": self.virtual,
                "bubble": self.bubble, "layers_per_stage": [len(s.layers) for s in self.stages],
                "in_flight": self.in_flight}


@functools.lru_cache(maxsize=256)
def _executed(schedule: str, p: int, m: int, v: int) -> tuple[float, tuple[float, ...]]:
    timeline = run(schedule, p, m, v)
    return timeline.idle_fraction(), tuple(n / v for n in timeline.peak_in_flight())


def pipeline_reasons(spec: Spec, layout: ParallelDims, shards: int) -> list[str]:
    """Why the spec's `[pipeline]` section cannot run on this layout's stages."""
    p, section = layout.stages, spec.pipeline
    if p == 1:
        return []
    reasons = [f"mesh pipeline size {p}: {field} {message}" for field, message in problems(
        stages=p, virtual_stages=section.virtual_stages, schedule=section.schedule,
        microbatches=section.microbatches, n_layers=spec.model.n_layers,
        layers_per_stage=section.layers_per_stage)]
    if section.schedule not in GENERATED:
        reasons.append(f"pipeline.schedule {section.schedule!r}: the planner models "
                       f"{', '.join(GENERATED)}")
    m = section.microbatches or p
    if spec.batch.micro % shards == 0 and (spec.batch.micro // shards) % m:
        reasons.append(f"pipeline.microbatches {m} does not divide the {spec.batch.micro // shards}"
                       " sequences of each batch shard")
    return reasons


def pipeline_plan(spec: Spec, layout: ParallelDims) -> PipelinePlan:
    """The pipeline of a layout that `pipeline_reasons` accepts."""
    p, section = layout.stages, spec.pipeline
    v = section.virtual_stages
    m = section.microbatches or p
    bubble, in_flight = _executed(section.schedule, p, m, v) if p > 1 else (0.0, (1.0,))
    return PipelinePlan(pipeline_stages(spec, p), section.schedule, m, v, bubble, list(in_flight))
