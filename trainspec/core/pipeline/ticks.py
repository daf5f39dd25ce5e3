"""An executed schedule as per-tick tables that an SPMD program can index: for each tick (one
slot of `schedule.execute` with F = B = one unit) and stage, the operation it runs and where
the data it reads and receives wait.

Every stage runs the same program; at tick t stage s reads row t, column s of each table. Data
that crosses stages lands in a per-stage buffer of numbered slots: the input of F(i, c) (the
activation from the previous chunk, which B(i, c) reads again to recompute the forward), and
the cotangent B(i, c) receives from the next chunk. Slots are allocated in time order and freed
once B(i, c) has run, so a buffer's size is the most data a stage holds at once: the schedule's
activation memory (GPipe m micro-batches, 1F1B at most p). The input of the model's first chunk
comes from the embedded batch and the last chunk's cotangent from the loss: neither waits in a
buffer. Writes that carry nothing go to the extra slot `trash` (= the buffer's size), so that a
program can write unconditionally. Pure integers: no framework.
"""
from __future__ import annotations

import dataclasses

from trainspec.core.pipeline.schedule import BACKWARD, FORWARD, Op, Slot, Timeline

IDLE_KIND, FORWARD_KIND, BACKWARD_KIND = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Ticks:
    """Tables [tick][stage] of ints; `activation_slots`, `gradient_slots`: buffer sizes."""

    kind: list[list[int]]          # IDLE_KIND, FORWARD_KIND or BACKWARD_KIND
    microbatch: list[list[int]]
    chunk: list[list[int]]         # the stage's local chunk c
    input_slot: list[list[int]]    # activation slot F and B read (trash for the first chunk)
    gradient_slot: list[list[int]]  # cotangent slot B reads (trash for the last chunk)
    receive_activation: list[list[int]]  # slot for what arrives from the previous stage
    receive_gradient: list[list[int]]    # slot for what arrives from the next stage
    activation_slots: int
    gradient_slots: int

    @property
    def count(self) -> int:
        return len(self.kind)


class _Slots:
    """Numbered slots of one stage's buffer: the lowest free one is taken."""

    def __init__(self):
        self.held: dict[tuple[int, int], int] = {}
        self.peak = 0

    def take(self, key: tuple[int, int]) -> int:
        used = set(self.held.values())
        slot = next(n for n in range(len(used) + 1) if n not in used)
        self.held[key] = slot
        self.peak = max(self.peak, len(self.held))
        return slot


def tables(timeline: Timeline) -> Ticks:
    """The tables of `timeline`, which must have run with F = B = one time unit."""
    slots, p, v = timeline.slots, len(timeline.slots), timeline.virtual
    last = p * v - 1
    activations, gradients = [_Slots() for _ in range(p)], [_Slots() for _ in range(p)]
    rows: dict[str, list[list[int]]] = {name: [] for name in (
        "kind", "microbatch", "chunk", "input_slot", "gradient_slot", "receive_activation",
        "receive_gradient")}
    for t in range(timeline.makespan):
        row = {name: [0] * p for name in rows}
        arrivals: list[tuple[str, int, tuple[int, int]]] = []
        for s in range(p):
            op: Op | None = slots[s][t].op
            row["input_slot"][s] = row["gradient_slot"][s] = -1
            row["receive_activation"][s] = row["receive_gradient"][s] = -1
            if op is None:
                continue
            key, k = (op.microbatch, op.chunk), op.chunk * p + s
            row["kind"][s] = FORWARD_KIND if op.kind == FORWARD else BACKWARD_KIND
            row["microbatch"][s], row["chunk"][s] = op.microbatch, op.chunk
            if k > 0:
                row["input_slot"][s] = activations[s].held[key]
            if op.kind == BACKWARD and k < last:
                row["gradient_slot"][s] = gradients[s].held.pop(key)
            if op.kind == BACKWARD and k > 0:
                activations[s].held.pop(key)
            # what this operation sends: F to the next chunk's stage, B to the previous one's
            if op.kind == FORWARD and k < last:
                arrivals.append(("receive_activation", (s + 1) % p, (op.microbatch, (k + 1) // p)))
            if op.kind == BACKWARD and k > 0:
                arrivals.append(("receive_gradient", (s - 1) % p, (op.microbatch, (k - 1) // p)))
        for table, stage, key in arrivals:  # after this tick's reads: freed slots are reusable
            buffer = activations if table == "receive_activation" else gradients
            row[table][stage] = buffer[stage].take(key)
        for name in rows:
            rows[name].append(row[name])
    activation_slots = max(b.peak for b in activations)
    gradient_slots = max(b.peak for b in gradients)
    for name, trash in (("input_slot", activation_slots), ("receive_activation", activation_slots),
                        ("gradient_slot", gradient_slots), ("receive_gradient", gradient_slots)):
        rows[name] = [[trash if x < 0 else x for x in row] for row in rows[name]]
    return Ticks(**rows, activation_slots=activation_slots, gradient_slots=gradient_slots)


def timeline(ticks: Ticks, virtual: int = 1) -> Timeline:
    """The slot list the tables run: what a backend that runs them executes, for the record
    and for `schedule.check`."""
    kinds = {FORWARD_KIND: FORWARD, BACKWARD_KIND: BACKWARD}
    p = len(ticks.kind[0])
    return Timeline([[Slot(Op(kinds[ticks.kind[t][s]], ticks.microbatch[t][s], ticks.chunk[t][s])
                           if ticks.kind[t][s] != IDLE_KIND else None)
                      for t in range(ticks.count)] for s in range(p)], virtual)
