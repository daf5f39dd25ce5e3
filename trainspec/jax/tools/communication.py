"""Communication options side by side: the loss each reaches over the same tokens, the bus
bytes its compiled programs move per step (from the HLO), and its step time.

Two ways to run an option: `train_option`, one `trainspec train` run (trainspec.jax.train.run: any
option, semi_sync included, with the bytes its records report, amortised over a DiLoCo round),
used by bench/communication.py (the table of docs/communication.md) and
notebooks/07_communication.ipynb; and `CompiledOption`, the step compiled once and trained
from several seeds (tests/jax/test_compression_convergence.py).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from trainspec.core.data import ByteBatches
from trainspec.core.spec import Spec
from trainspec.jax.train import build_job, run


@dataclasses.dataclass
class Run:
    """One option trained from one seed: the loss of every step, the step time (CompiledOption:
    the median; train_option: the run summary's mean) and, from train_option, the bus bytes."""

    label: str
    seed: int
    losses: list[float]
    step_time_s: float
    bus_bytes: float | None = None  # per device per step over all mesh axes (amortised: DiLoCo)

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
        self.job.step.compile(self.job.abstract_state, self.job.step.shard_batch(self.data.batch(0)))

    def train(self, seed: int, steps: int, *, seed_data: bool = False) -> Run:
        """With `seed_data`, the data order is `seed`'s too (as the spec's `seed` sets both)."""
        step = self.job.step
        data = (ByteBatches(self.spec.batch.seq_len, self.spec.batch.global_batch, seed)
                if seed_data else self.data)
        state = step.init(self.job.init_fn, jax.random.key(seed))
        step.reset_guard()
        losses, times = [], []
        for index in range(steps):
            start = time.perf_counter()
            state, metrics = step(state, data.batch(index))
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
            losses.append(float(step.host_metrics(metrics)["loss"]))
        return Run(self.label, seed, losses, statistics.median(times))


def margin_from_seeds(runs: list[Run], last: int) -> float:
    """The spread (max - min) of the final losses of the synchronous runs from several seeds:
    a compressed run whose final loss differs from the synchronous one by less is within the
    noise of initialisation."""
    finals = [r.final_loss(last) for r in runs]
    return max(finals) - min(finals)


def train_option(label: str, spec: Spec, run_dir: Path, steps: int | None = None) -> Run:
    """`spec` trained by `trainspec train`'s loop from step 0 into `run_dir` with a record per
    step: its losses, the records' `comm_bus_bytes_per_step` (from the compiled HLO) and the
    summary's mean step time."""
    spec = spec.model_copy(update={
        "metrics": spec.metrics.model_copy(update={"interval": 1}),
        "checkpoint": spec.checkpoint.model_copy(update={"interval": 0})})
    summary = run(spec, Path(run_dir), steps, spec_label=label, progress=False, restart=True)
    records = [json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()
               if line.strip()]
    facts = next(r for r in records if "comm_bus_bytes_per_step" in r)
    return Run(label, spec.seed, [r["loss"] for r in records if r.get("loss") is not None],
               summary["step_time_s"], facts["comm_bus_bytes_per_step"])
