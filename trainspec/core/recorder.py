"""Recorder: the metrics records of a run, built once for every implementation.

The loop tells it about every step (`after_step`); it keeps only references to the step's
values and adds host timings, and writes a record when one is due (`metrics.interval`, the first
step, the last, or one the loop asks for). The record's one host-device synchronisation is
`reader.to_host`, at the record. The step's static facts (FLOPs, peak, memory, communication,
compile time) are measured once by the implementation and passed in as `facts`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from trainspec.core import flops, records
from trainspec.core.gns import NoiseScale, record_fields
from trainspec.core.goodput import Goodput
from trainspec.core.semi_sync import combine_groups


class Sink(Protocol):
    def write(self, record: dict) -> None: ...
    def rewind(self, step: int) -> dict[int, float]:
        """Forget records past `step` (work about to be redone after a resume or rollback);
        returns the losses of the records kept, by step."""
    def close(self) -> None: ...


class MetricsReader(Protocol):
    """How an implementation's step metrics reach the record (trainspec.jax's WrappedStep is one)."""

    def to_host(self, tree: Any) -> Any:
        """The tree's values as host numbers: the record's one synchronisation (under
        [semi_sync] one value per group, which trainspec.core.semi_sync combines)."""


class OnHost:
    """The reader of a step whose metrics are host numbers already (a loop of its own)."""

    @staticmethod
    def to_host(tree):
        return tree


def aux_fields(tree, prefix: str = "") -> dict[str, float | None]:
    """The scalar leaves of a step's `aux` by path ('a/b', list items by index); a leaf of
    more than one element is left out of the record."""
    items = (tree.items() if isinstance(tree, dict) else enumerate(tree)
             if isinstance(tree, (list, tuple)) else None)
    if items is None:
        return {prefix: records.finite_or_none(float(np.asarray(tree)))} \
            if np.size(tree) == 1 else {}
    out = {}
    for key, value in items:
        out.update(aux_fields(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


class Recorder:
    """Collects per-step values and host timings; writes a record per interval to `sinks`.

    `per_record()`: fields measured afresh at each record (e.g. live memory); `first_step` is
    always recorded (1, or the step after a resume)."""

    def __init__(self, spec, facts: dict, sinks: list[Sink], total_steps: int,
                 goodput: Goodput | None = None, first_step: int = 1,
                 reader: MetricsReader = OnHost(), per_record: Callable[[], dict] = dict):
        self.spec, self.sinks, self.reader, self.per_record = spec, sinks, reader, per_record
        self.total_steps, self.interval = total_steps, spec.metrics.interval
        self.goodput = goodput or Goodput()
        self.tokens_per_step = flops.tokens_per_step(spec)
        self.last: dict | None = None
        self.losses: dict[int, float] = {}  # recorded losses by step, a resumed run's included
        self.records: int = 0
        self._seconds, self._timed_steps, self._valid_tokens = 0.0, 0, 0.0
        self.restart(facts, first_step)

    def restart(self, facts: dict, first_step: int) -> None:
        """(Re)start recording at `first_step` with the step's `facts`: after a resume, or a
        rollback onto another step or mesh. Records after `first_step - 1` are dropped."""
        self.facts, self.first_step = facts, first_step
        if facts.get("compile_time_s"):
            self.goodput.add("compilation", facts["compile_time_s"])
        self.rewind(first_step - 1)
        self.noise_scale = NoiseScale()  # the window of the newest steps restarts from here
        self._pending_tokens: list = []
        self._pending_gns: list = []  # per-step (|G|^2, tr Sigma) estimates, still on device
        self._pending_steps, self._pending_wait = 0, 0.0
        self._t_last = None

    def rewind(self, step: int) -> None:
        for sink in self.sinks:
            self.losses.update(sink.rewind(step))
        self.losses = {s: loss for s, loss in self.losses.items() if s <= step}

    def start(self) -> None:
        """Call right before the first step: intervals are timed from here."""
        self._t_last = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation between steps) out of the interval's step time."""
        self._t_last += seconds

    def due(self, step: int) -> bool:
        return step == self.first_step or step % self.interval == 0 or step == self.total_steps

    def after_step(self, step: int, metrics: dict, data_wait_s: float = 0.0,
                   extra: Callable[[dict], dict] | None = None, due: bool = False) -> dict | None:
        """Note one finished step; returns the record when one is written, else None.
        `extra(host_metrics)` (e.g. health fields) is called only when a record is due, with
        the step's metrics as the record reads them (on the host), and merged in; `due` asks
        for a record at this step off the interval (a checkpoint follows it)."""
        if self._t_last is None:
            self.start()
        self._pending_steps += 1
        self._pending_wait += data_wait_s
        if "valid_tokens" in metrics:
            self._pending_tokens.append(metrics["valid_tokens"])  # a reference: no sync
        if "gns_grad_sq" in metrics:
            self._pending_gns.append((metrics["gns_grad_sq"], metrics["gns_trace"]))
        if not (due or self.due(step)):
            return None
        return self._record(step, metrics, extra)

    def _record(self, step: int, metrics: dict, extra: Callable[[dict], dict] | None) -> dict:
        now_metrics, tokens, gns_parts = self.reader.to_host(  # the interval's one host sync
            (metrics, self._pending_tokens, self._pending_gns))
        now_metrics = combine_groups(now_metrics)
        extra_fields = extra(now_metrics) if extra else {}
        aux = records.user_aux(now_metrics.get("aux"))
        for grad_sq, trace in gns_parts:
            if np.isfinite(grad_sq) and np.isfinite(trace):  # a skipped (non-finite) step
                self.noise_scale.update(grad_sq, trace)
        now = time.perf_counter()
        wall = now - self._t_last
        n = self._pending_steps
        # nansum: a non-finite count (a NaN mask) is a bad step that trained no token (the
        # skip guard zeroes it on device; under rollback the step is undone later)
        valid = float(np.nansum(tokens)) if tokens else float(self.tokens_per_step * n)
        self._seconds += wall
        self._timed_steps += n
        self._valid_tokens += valid
        self.goodput.interval(n, wall, self._pending_wait)
        record = {
            "schema": records.SCHEMA_ID,
            "step": step,
            "steps_in_interval": n,
            "time": time.time(),
            "loss": records.finite_or_none(now_metrics.get("loss")),
            "grad_norm": records.finite_or_none(now_metrics.get("grad_norm")),
            "learning_rate": None,  # the loop knows the schedule and sets it through `extra`
            **records.interval_fields(self.facts, n, wall, valid, self.tokens_per_step,
                                      self._pending_wait, self.goodput.summary(now)),
            **self.per_record(),
            **record_fields(self.noise_scale.estimate()),
            **({"aux": aux_fields(aux)} if aux else {}),
            **records.moe_fields(now_metrics.get("aux")),
            **extra_fields,
        }
        for sink in self.sinks:
            sink.write(record)
        self.last = record
        self.losses[step] = float("nan") if record["loss"] is None else record["loss"]
        self.records += 1
        self._pending_tokens, self._pending_steps, self._pending_wait = [], 0, 0.0
        self._pending_gns = []
        self._t_last = time.perf_counter()  # writing the record is not step time
        return record

    def summary(self) -> dict:
        """Run-level numbers for the loop's summary: means over every recorded step."""
        return {
            **records.run_fields(self.facts, self._seconds, self._timed_steps,
                                 self._valid_tokens, self.goodput.summary(), self.losses,
                                 self.total_steps),
            **record_fields(self.noise_scale.estimate()),
        }

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
