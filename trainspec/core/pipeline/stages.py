"""Which layers each pipeline stage holds, and the checks of a `[pipeline]` section that need
the number of stages (docs/spec.md, `pipeline`).

With p stages and v virtual stages per stage there are p·v model chunks. Chunk k holds a
contiguous run of layers, in order; chunk k runs on stage k mod p (the looped placement of
Narayanan et al. 2021, section 2.2: with v > 1 each stage holds v chunks, p apart). The
embedding is on the first chunk (stage 0) and the final norm and head on the last (stage p-1).

Pure integers and strings: the spec's validation (trainspec.core.spec) calls `problems` where
the pipeline degree is known when the spec is read, mesh resolution where it is inferred.
"""
from __future__ import annotations

from collections.abc import Sequence

INTERLEAVED = "interleaved_1f1b"


def chunk_layers(n_layers: int, chunks: int,
                 layers_per_chunk: Sequence[int] = ()) -> list[range]:
    """The layers of each chunk: `layers_per_chunk` when given, else an even split
    (`problems` has refused a split that is not)."""
    counts = list(layers_per_chunk) or [n_layers // chunks] * chunks
    out, start = [], 0
    for count in counts:
        out.append(range(start, start + count))
        start += count
    return out


def stage_of_chunk(chunk: int, stages: int) -> int:
    return chunk % stages


def problems(*, stages: int, virtual_stages: int, schedule: str, microbatches: int | None,
             n_layers: int, layers_per_stage: Sequence[int]) -> list[tuple[str, str]]:
    """(field, message) for each way the section cannot run on `stages` stages; empty if it
    can. One stage (no pipeline axis split) checks nothing: the section has no effect."""
    if stages <= 1:
        return []
    out = []
    chunks = stages * virtual_stages
    if schedule != INTERLEAVED and virtual_stages != 1:
        out.append(("pipeline.virtual_stages", f"{virtual_stages} needs schedule = "
                    f"\"{INTERLEAVED}\" (schedule {schedule!r} runs one chunk per stage)"))
    if schedule == INTERLEAVED and virtual_stages < 2:
        out.append(("pipeline.virtual_stages", f"schedule \"{INTERLEAVED}\" needs at least 2 "
                    f"virtual stages per stage, got {virtual_stages}"))
    m = microbatches if microbatches is not None else stages
    if schedule == INTERLEAVED and m % stages:
        # The interleaved schedule runs micro-batches through the chunks in groups of p
        # (Narayanan et al. 2021, section 2.2; Megatron-LM asserts the same)
        out.append(("pipeline.microbatches", f"{m} is not a multiple of the {stages} pipeline "
                    f"stages, as schedule \"{INTERLEAVED}\" needs"))
    if layers_per_stage:
        if len(layers_per_stage) != chunks:
            out.append(("pipeline.layers_per_stage", f"lists {len(layers_per_stage)} stages, "
                        f"but the mesh has {stages} pipeline stages x {virtual_stages} virtual "
                        f"stages = {chunks}"))
        elif sum(layers_per_stage) != n_layers:
            out.append(("pipeline.layers_per_stage", f"sums to {sum(layers_per_stage)} layers, "
                        f"but model.n_layers is {n_layers}"))
        elif min(layers_per_stage) < 1:
            out.append(("pipeline.layers_per_stage", "every stage needs at least one layer, "
                        f"got {list(layers_per_stage)}"))
    elif n_layers % chunks:
        out.append(("model.n_layers", f"{n_layers} layers do not split evenly over {stages} "
                    f"pipeline stages x {virtual_stages} virtual stages = {chunks} chunks; "
                    "list them in pipeline.layers_per_stage"))
    return out


def microbatch_order(rows: int, microbatches: int) -> list[int]:
    """The rows of one accumulation micro-batch in pipeline micro-batch order: pipeline
    micro-batch i holds rows i, i + m, i + 2m, ... (docs/spec.md), so taking the returned
    rows in m equal contiguous parts gives micro-batches 0, 1, ..., m − 1."""
    m = microbatches
    return [i + m * r for i in range(m) for r in range(rows // m)]
