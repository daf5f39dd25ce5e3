"""Standard training metrics: MFU/HFU, memory, communication volume, input stalls, goodput.

Definitions are normative in docs/metrics.md; records follow docs/metrics.schema.json.
"""
from spec_jax.metrics.flops import TransformerFlops, peak_flops
from spec_jax.metrics.goodput import Goodput
from spec_jax.metrics.logger import MetricsLogger, StepAnalysis, analyze_step
from spec_jax.metrics.records import SCHEMA_ID

__all__ = ["MetricsLogger", "StepAnalysis", "analyze_step", "TransformerFlops", "peak_flops",
           "Goodput", "SCHEMA_ID"]
