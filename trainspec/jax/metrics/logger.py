"""The JAX step's record facts, measured once from the compiled program that runs
(`analyze_step`: FLOPs, memory, communication, compile time), and MetricsLogger, the core
Recorder (trainspec.core.recorder) over them.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from trainspec.core import flops
from trainspec.core.goodput import Goodput
from trainspec.core.recorder import Recorder, Sink
from trainspec.jax.metrics import comm, memory
from trainspec.jax.metrics.flops import peak_flops, xla_flops_per_step
from trainspec.core.sinks import sinks_for
from trainspec.jax.runtime import is_writer


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


class MetricsLogger(Recorder):
    """The core Recorder over a compiled JAX step: its facts from `analyze_step`, live memory
    per record, the wrapped step's own reading of its metrics onto the host."""

    def __init__(self, spec, wrapped_step, sinks: list[Sink], analysis: StepAnalysis,
                 total_steps: int, goodput: Goodput | None = None, first_step: int = 1):
        self.analysis = analysis
        super().__init__(spec, analysis.fields, sinks, total_steps, goodput, first_step,
                         reader=wrapped_step, per_record=live_memory)

    @classmethod
    def for_run(cls, spec, wrapped_step, state, first_batch, run_dir: Path, total_steps: int,
                model_flops: flops.ModelFlops | None = None, goodput: Goodput | None = None,
                resume_after: int | None = None):
        """Analyse (and compile) the step, open the spec's sinks under `run_dir`.

        `resume_after`: the step a resumed run continues from; the sinks keep (and the logger
        knows the losses of) the records up to it, and drop those after it."""
        analysis = analyze_step(wrapped_step, state, first_batch, model_flops)
        sinks = sinks_for(spec, run_dir, is_writer(), append=resume_after is not None)
        return cls(spec, wrapped_step, sinks, analysis, total_steps, goodput,
                   (resume_after or 0) + 1)


def live_memory() -> dict:
    """The record's per-record memory field: what the devices hold now."""
    return {"memory_live_bytes": memory.live_bytes()}
