"""MetricsLogger: what the training loop calls once per step; records once per interval.

`after_step` only keeps references to the step's device arrays and adds host timings; the one
host-device synchronisation happens when a record is due (`metrics.interval`, the first and the
last step). Static facts of the step (FLOPs, memory, communication, compile time) are measured
once, from the compiled program that runs (`analyze_step`).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from trainspec.core.gns import NoiseScale, record_fields
from trainspec.core import flops, records
from trainspec.core.goodput import Goodput
from trainspec.jax.metrics import comm, memory
from trainspec.jax.metrics.flops import peak_flops, xla_flops_per_step
from trainspec.jax.metrics.sinks import Sink, sinks_for


@dataclasses.dataclass
class StepAnalysis:
    """Facts of one compiled step that do not change from step to step."""

    fields: dict[str, Any]        # record fields (flops, memory, comm, compile time, peak)
    comm: comm.CommVolume | None
    compiled: Any = None


def analyze_step(wrapped_step, state, batch, model_flops: flops.ModelFlops | None = None,
                 compile: bool = True) -> StepAnalysis:
    """Compile `wrapped_step` for (state, batch) (unless already compiled) and measure it.

    With `compile`, the step runs the analysed executable from now on (WrappedStep.compile),
    so the program is compiled once. `model_flops` gives the analytic counts; without it only
    XLA's count is known (a user's own model).
    """
    spec = wrapped_step.spec
    t0 = time.perf_counter()
    compiled = wrapped_step.compile(state, batch) if compile else wrapped_step.lower(state, batch).compile()
    compile_time = time.perf_counter() - t0
    n_devices = int(wrapped_step.mesh.devices.size)
    tokens = flops.tokens_per_step(spec)
    convention = spec.metrics.flops_convention
    xla = xla_flops_per_step(wrapped_step, state, batch)
    if model_flops is not None:
        model = model_flops.model_per_token(convention) * tokens
        hardware = model_flops.hardware_per_token() * tokens
    else:
        model, hardware, convention = None, xla, None
    volume = wrapped_step.comm_volume(compiled)  # per step (amortised under semi_sync)
    peak = peak_flops(spec, list(wrapped_step.mesh.devices.flat))
    fields = {
        "model_flops_per_step": model,
        "flops_convention": convention,
        "hardware_flops_per_step": hardware,
        "xla_flops_per_step": xla,
        "peak_flops_per_device": peak.flops_per_device,
        "peak_flops_source": peak.source,
        "n_devices": n_devices,
        **memory.compiled_memory(compiled),
        "comm_bytes_per_step": volume.total_bytes,
        "comm_bus_bytes_per_step": volume.bus_bytes,
        "comm_bytes_by_kind": volume.by_kind(),
        "comm_bytes_by_axis": volume.by_axis(),
        "compile_time_s": compile_time,
        "batch_tokens": tokens,
        "gns_source": wrapped_step.gns_source,
    }
    return StepAnalysis(fields, volume, compiled)


class MetricsLogger:
    """Collects per-step device values and host timings; writes a record per interval."""

    def __init__(self, spec, sinks: list[Sink], analysis: StepAnalysis, total_steps: int,
                 goodput: Goodput | None = None, first_step: int = 1, wrapped_step=None):
        self.spec, self.sinks, self.analysis = spec, sinks, analysis
        # reads the step's metrics onto the host (SemiSyncStep: combines its groups' values)
        self.wrapped_step = wrapped_step
        self.total_steps, self.interval = total_steps, spec.metrics.interval
        self.first_step = first_step  # always recorded (1, or the step after a resume)
        self.goodput = goodput or Goodput()
        self.tokens_per_step = flops.tokens_per_step(spec)
        self.last: dict | None = None
        self.losses: dict[int, float] = {}  # recorded losses by step, a resumed run's included
        self.records: int = 0
        self._pending_tokens: list = []
        self._pending_gns: list = []  # per-step (|G|^2, tr Sigma) estimates, still on device
        self.noise_scale = NoiseScale()  # the newest steps' estimates (after a resume: its own)
        self._pending_steps, self._pending_wait = 0, 0.0
        self._t_last = None
        self._seconds, self._timed_steps, self._valid_tokens = 0.0, 0, 0.0
        if analysis.fields.get("compile_time_s"):
            self.goodput.add("compilation", analysis.fields["compile_time_s"])

    @classmethod
    def for_run(cls, spec, wrapped_step, state, first_batch, run_dir: Path, total_steps: int,
                model_flops: flops.ModelFlops | None = None, goodput: Goodput | None = None,
                resume_after: int | None = None):
        """Analyse (and compile) the step, open the spec's sinks under `run_dir`.

        `resume_after`: the step a resumed run continues from; the sinks keep (and the logger
        knows the losses of) the records up to it, and drop those after it."""
        goodput = goodput or Goodput()
        analysis = analyze_step(wrapped_step, state, first_batch, model_flops)
        sinks = sinks_for(spec, run_dir, append=resume_after is not None)
        logger = cls(spec, sinks, analysis, total_steps, goodput, (resume_after or 0) + 1,
                     wrapped_step)
        if resume_after is not None:
            logger._rewind(resume_after)
        return logger

    def _rewind(self, step: int) -> None:
        for sink in self.sinks:
            self.losses.update(sink.rewind(step))
        self.losses = {s: loss for s, loss in self.losses.items() if s <= step}

    def restart(self, spec, wrapped_step, state, batch, first_step: int,
                model_flops: flops.ModelFlops | None = None) -> None:
        """After a rollback onto another step/mesh: drop the records after `first_step - 1`,
        analyse the new step, time afresh."""
        self.spec, self.first_step, self.wrapped_step = spec, first_step, wrapped_step
        self._rewind(first_step - 1)
        self.analysis = analyze_step(wrapped_step, state, batch, model_flops)
        self.goodput.add("compilation", self.analysis.fields["compile_time_s"])
        self._pending_tokens, self._pending_steps, self._pending_wait = [], 0, 0.0
        self._pending_gns = []
        self.noise_scale = NoiseScale()  # the window restarts from the restored state
        self._t_last = None

    def start(self) -> None:
        """Call right before the first step: intervals are timed from here."""
        self._t_last = time.perf_counter()

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
        to_host = self.wrapped_step.to_host if self.wrapped_step else jax.device_get
        now_metrics, tokens, gns_parts = to_host(  # the interval's one host sync
            (metrics, self._pending_tokens, self._pending_gns))
        if self.wrapped_step:
            now_metrics = self.wrapped_step.combine_metrics(now_metrics)
        extra_fields = extra(now_metrics) if extra else {}
        loss, grad_norm = now_metrics.get("loss"), now_metrics.get("grad_norm")
        for grad_sq, trace in gns_parts:
            if np.isfinite(grad_sq) and np.isfinite(trace):  # a skipped (non-finite) step
                self.noise_scale.update(grad_sq, trace)
        now = time.perf_counter()
        wall = now - self._t_last
        n = self._pending_steps
        valid = float(np.sum(tokens)) if tokens else float(self.tokens_per_step * n)
        self._seconds += wall
        self._timed_steps += n
        self._valid_tokens += valid
        self.goodput.interval(n, wall, self._pending_wait)
        record = {
            "schema": records.SCHEMA_ID,
            "step": step,
            "steps_in_interval": n,
            "time": time.time(),
            "loss": records.finite_or_none(loss),
            "grad_norm": records.finite_or_none(grad_norm),
            "learning_rate": None,  # the loop knows the schedule and sets it through `extra`
            **records.interval_fields(self.analysis.fields, n, wall, valid, self.tokens_per_step,
                                      self._pending_wait, self.goodput.summary(now)),
            "memory_live_bytes": memory.live_bytes(),
            **record_fields(self.noise_scale.estimate()),
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
            **records.run_fields(self.analysis.fields, self._seconds, self._timed_steps,
                                 self._valid_tokens, self.goodput.summary(), self.losses,
                                 self.total_steps),
            **record_fields(self.noise_scale.estimate()),
        }

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
