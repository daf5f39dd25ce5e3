"""Communication options side by side: the loss each reaches over the same tokens, the gradient
bytes its compiled step moves over the data axes, and its step time.

Used by bench/communication.py (the table of docs/communication.md), the tests of convergence
and error feedback (tests/test_compression_convergence.py) and notebooks/07_communication.ipynb.
One option is one spec, compiled once: runs from other seeds reuse its executable.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

from spec_jax.core.data import ByteBatches
from spec_jax.core.spec import Spec
from spec_jax.metrics.comm import analyze_compiled
from spec_jax.train import build_job


@dataclasses.dataclass
class Run:
    """One option trained from one seed: the loss of every step, and the median step time."""

    label: str
    seed: int
    losses: list[float]
    step_time_s: float

    def final_loss(self, last: int) -> float:
        """Mean loss of the last `last` steps: one step's loss is one batch's noise."""
        return float(np.mean(self.losses[-last:]))


class CompiledOption:
    """The reference job under `spec`, its step compiled once; `train(seed, steps)` runs it from
    the parameters `seed` initialises, always on the data of `spec.seed` (the same tokens)."""

    def __init__(self, label: str, spec: Spec):
        self.label, self.spec = label, spec
        self.job = build_job(spec, init=False)
        self.data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
        step = self.job.step
        compiled = step.compile(self.job.abstract_state, step.shard_batch(self.data.batch(0)))
        volume = analyze_compiled(compiled, step.mesh)
        data_axes = set(spec.mesh.axes_with_role("data"))
        # bus bytes per device per step over the data axes (nccl-tests factors), from the HLO
        self.bus_bytes = sum(c.bus_bytes_per_step for c in volume.collectives
                             if c.axes and set(c.axes) <= data_axes)

    def train(self, seed: int, steps: int) -> Run:
        step = self.job.step
        state = step.init(self.job.init_fn, jax.random.key(seed))
        step.reset_guard()
        losses, times = [], []
        for index in range(steps):
            start = time.perf_counter()
            state, metrics = step(state, self.data.batch(index))
            losses.append(metrics["loss"])
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - start)
        return Run(self.label, seed, [float(x) for x in losses], statistics.median(times))


def margin_from_seeds(runs: list[Run], last: int) -> float:
    """The spread (max - min) of the final losses of the synchronous runs from several seeds:
    a compressed run whose final loss differs from the synchronous one by less is within the
    noise of initialisation."""
    finals = [r.final_loss(last) for r in runs]
    return max(finals) - min(finals)
