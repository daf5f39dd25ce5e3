"""Standard training metrics: MFU/HFU, memory, communication volume, input stalls, goodput.

Definitions are normative in docs/metrics.md; the record format, formulas and goodput are
trainspec.core's (records, flops, goodput); this package measures a JAX step.
"""
from trainspec.jax.metrics.flops import peak_flops
from trainspec.jax.metrics.logger import MetricsLogger, StepAnalysis, analyze_step

__all__ = ["MetricsLogger", "StepAnalysis", "analyze_step", "peak_flops"]
