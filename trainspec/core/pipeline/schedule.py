"""Pipeline schedules as explicit per-stage slot lists, what they cost, and a check that a
slot list respects the dependencies between stages.

A schedule is, per stage, the order of its operations: F(i, c) is the forward of micro-batch i
through the stage's local chunk c, B(i, c) its backward. Chunk c of stage s is model chunk
k = c·p + s (the looped placement, trainspec.core.pipeline.stages). `execute` runs the orders
under a cost model (F takes `forward` time units, B `backward`; transfers are free): every
operation starts as soon as its stage is free and its inputs exist. The result is one slot per
time unit per stage (F, B or idle), from which the idle fraction (the bubble) and the
activations each stage holds are measured, not assumed.

Dependencies: F(i, k) needs F(i, k−1) done (the activation from the previous chunk); B(i, k)
needs B(i, k+1) done (the gradient from the next chunk), and the last chunk's B(i) its own
F(i). A backend that records the schedule it ran can hand its slots to `check` (docs/spec.md,
`pipeline`; the orders follow Huang et al. 2019 for GPipe, Narayanan et al. 2021 for 1F1B
(PipeDream-flush) and its interleaved form).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trainspec.core.pipeline.stages import INTERLEAVED

FORWARD, BACKWARD, IDLE = "F", "B", "idle"
GENERATED = ("gpipe", "1f1b", INTERLEAVED)  # the schedules the core generates


class ScheduleError(ValueError):
    """A slot list or an order that cannot run: a dependency broken, an operation missing,
    repeated or never reachable."""


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str          # FORWARD or BACKWARD
    microbatch: int
    chunk: int         # the stage's local chunk c (model chunk c·p + stage)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclasses.dataclass(frozen=True)
class Slot:
    """One time unit of one stage: the operation running in it, or None (idle)."""

    op: Op | None

    def __str__(self) -> str:
        return str(self.op) if self.op else "."


def _interleaved_op(k: int, p: int, v: int, backward: bool) -> Op:
    """The k-th forward (or backward) of a stage under the interleaved schedule: micro-batches
    in groups of p through each chunk in turn (backwards through the chunks last to first)."""
    chunk = (k // p) % v
    microbatch = (k // (p * v)) * p + k % p
    return Op(BACKWARD if backward else FORWARD, microbatch, v - 1 - chunk if backward else chunk)


def orders(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Op]]:
    """Each stage's operations in the order it runs them."""
    p, m, v = stages, microbatches, virtual
    if schedule not in GENERATED:
        raise ScheduleError(f"pipeline.schedule: the core generates {', '.join(GENERATED)}, "
                            f"not {schedule!r}")
    if schedule != INTERLEAVED:
        v = 1
    out = []
    for s in range(p):
        forwards = [_interleaved_op(k, p, v, False) for k in range(m * v)]
        backwards = [_interleaved_op(k, p, v, True) for k in range(m * v)]
        if schedule == "gpipe":  # the backward of the whole forward: last micro-batch first
            out.append(forwards + backwards[::-1])
            continue
        if schedule == "1f1b":
            warmup = min(p - s - 1, m)
        else:  # Megatron-LM's warm-up: enough forwards that the steady state never waits
            warmup = min(2 * (p - s - 1) + (v - 1) * p, m * v)
        order = forwards[:warmup]
        for k in range(m * v - warmup):
            order += [forwards[warmup + k], backwards[k]]
        out.append(order + backwards[m * v - warmup:])
    return out


def _inputs(op: Op, stage: int, p: int, v: int) -> tuple[int, Op] | None:
    """(stage, operation) that must finish before `op` on `stage` may start; None: none."""
    k = op.chunk * p + stage
    if op.kind == FORWARD:
        if k == 0:
            return None
        k -= 1
    elif k == p * v - 1:
        return stage, Op(FORWARD, op.microbatch, op.chunk)
    else:
        k += 1
    return k % p, Op(op.kind, op.microbatch, k // p)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The executed schedule: slots[stage][t] for t < makespan."""

    slots: list[list[Slot]]
    virtual: int

    @property
    def makespan(self) -> int:
        return len(self.slots[0])

    def idle_fraction(self) -> float:
        idle = sum(slot.op is None for stage in self.slots for slot in stage)
        return idle / (len(self.slots) * self.makespan)

    def in_flight(self, stage: int) -> list[int]:
        """Chunk activations the stage holds at each time unit: a forward's from its start
        until its backward ends."""
        held, out, previous = 0, [], None
        for slot in self.slots[stage]:
            if slot.op is not None and slot.op != previous and slot.op.kind == FORWARD:
                held += 1
            out.append(held)
            if previous is not None and previous != slot.op and previous.kind == BACKWARD:
                out[-1] = held = held - 1  # the backward before this slot ended
            previous = slot.op
        return out

    def peak_in_flight(self) -> list[int]:
        """Per stage, the most chunk activations held at once (each chunk 1/v of the
        stage's layers)."""
        return [max(self.in_flight(s)) for s in range(len(self.slots))]

    def text(self) -> str:
        """One line per stage, one cell per time unit."""
        width = max(len(str(slot)) for stage in self.slots for slot in stage)
        return "\n".join(f"stage {s}: " + " ".join(f"{str(x):>{width}}" for x in stage)
                         for s, stage in enumerate(self.slots))


def execute(stage_orders: Sequence[Sequence[Op]], virtual: int = 1, forward: int = 1,
            backward: int = 1) -> Timeline:
    """Run each stage's order, every operation as early as its stage and inputs allow."""
    p = len(stage_orders)
    done: dict[tuple[int, Op], int] = {}  # (stage, op) -> end time
    free, position = [0] * p, [0] * p
    starts: list[list[tuple[int, Op]]] = [[] for _ in range(p)]
    while any(position[s] < len(stage_orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(stage_orders[s]):
                op = stage_orders[s][position[s]]
                need = _inputs(op, s, p, virtual)
                if need is not None and need not in done:
                    break
                start = max(free[s], done[need] if need is not None else 0)
                free[s] = done[(s, op)] = start + (forward if op.kind == FORWARD else backward)
                starts[s].append((start, op))
                position[s] += 1
                progressed = True
        if not progressed:
            waiting = [f"stage {s} at {stage_orders[s][position[s]]}" for s in range(p)
                       if position[s] < len(stage_orders[s])]
            raise ScheduleError("the orders deadlock: " + ", ".join(waiting))
    makespan = max(free)
    slots = []
    for s in range(p):
        row = [Slot(None)] * makespan
        for start, op in starts[s]:
            end = done[(s, op)]
            row[start:end] = [Slot(op)] * (end - start)
        slots.append(row)
    timeline = Timeline(slots, virtual)
    check(timeline, len({op.microbatch for op in stage_orders[0]}))
    return timeline


def check(timeline: Timeline, microbatches: int) -> None:
    """ScheduleError unless every stage runs F and B of every micro-batch and chunk exactly
    once and no operation starts before its input has finished."""
    p, v = len(timeline.slots), timeline.virtual
    span: dict[tuple[int, Op], tuple[int, int]] = {}
    for s, row in enumerate(timeline.slots):
        t = 0
        while t < len(row):
            op, start = row[t].op, t
            while t < len(row) and row[t].op == op:
                t += 1
            if op is None:
                continue
            if (s, op) in span:
                raise ScheduleError(f"stage {s} runs {op} twice")
            span[(s, op)] = (start, t)
    for s in range(p):
        for mb in range(microbatches):
            for c in range(v):
                for kind in (FORWARD, BACKWARD):
                    op = Op(kind, mb, c)
                    if (s, op) not in span:
                        raise ScheduleError(f"stage {s} never runs {op}")
                    need = _inputs(op, s, p, v)
                    if need is not None and span[need][1] > span[(s, op)][0]:
                        raise ScheduleError(
                            f"stage {s} starts {op} at {span[(s, op)][0]} before stage "
                            f"{need[0]} finishes {need[1]} at {span[need][1]}")


def run(schedule: str, stages: int, microbatches: int, virtual: int = 1, forward: int = 1,
        backward: int = 1) -> Timeline:
    v = virtual if schedule == INTERLEAVED else 1
    return execute(orders(schedule, stages, microbatches, v), v, forward, backward)


def summary(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> dict:
    """What a run records of its pipeline: the schedule, its executed slots (one string per
    stage, F = B = one unit) and their idle fraction."""
    timeline = run(schedule, stages, microbatches, virtual)
    return {"schedule": schedule, "stages": stages, "microbatches": microbatches,
            "virtual_stages": virtual, "idle_fraction": timeline.idle_fraction(),
            "slots": [" ".join(map(str, row)) for row in timeline.slots]}


def run_record(spec, mesh_shape: dict[str, int]) -> dict | None:
    """`summary` of the pipeline a run of `spec` on a mesh of `mesh_shape` executes; None
    without a split pipeline axis."""
    axes = spec.mesh.axes_with_role("pipeline")
    stages = mesh_shape.get(axes[0], 1) if axes else 1
    section = spec.pipeline
    if stages == 1 or section.schedule not in GENERATED:
        return None
    return summary(section.schedule, stages, section.microbatches or stages,
                   section.virtual_stages if section.schedule == INTERLEAVED else 1)


def bubble_formula(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Narayanan et al. 2021 (section 2.2): (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1)."""
    v = virtual if schedule == INTERLEAVED else 1
    return (stages - 1) / (v * microbatches + stages - 1)
