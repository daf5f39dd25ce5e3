"""FLOPs of a JAX step: XLA's own count, the peak of jax devices, parameter counts.

The conventions, the peak table and the utilisation formula are trainspec.core.flops's; the
reference model's analytic count is trainspec.core.transformer_flops.
"""
from __future__ import annotations

import jax
import numpy as np

from trainspec.core import flops as core_flops
from trainspec.core.spec import Spec
from trainspec.jax.metrics import cpu_peak


def xla_flops_per_step(wrapped_step, state, batch) -> float | None:
    """XLA's cost analysis of the step as lowered (whole program, before SPMD partitioning).

    XLA's cost analysis counts a while-loop body once, whatever its trip count, so a step that
    accumulates micro-batches (a loop) is analysed as the step lowers for it: one micro-batch of
    the whole global batch (WrappedStep.lower_for_cost_analysis). Returns None where the backend
    gives no cost analysis.
    """
    cost = wrapped_step.lower_for_cost_analysis(state, batch).cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per program
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def peak_flops(spec: Spec, devices=None) -> core_flops.Peak:
    """Peak FLOP/s of one of `devices` (default: jax.devices()), per trainspec.core.flops; on a
    CPU, this machine's measured matmul peak (metrics.cpu_peak, cached per machine)."""
    devices = devices if devices is not None else jax.devices()
    local_cpus = sum(1 for d in jax.local_devices() if d.platform == "cpu")
    kind = devices[0].device_kind
    measured = None  # only measured where it is used: a CPU and no override in the spec
    if core_flops.device_kind_key(kind) == "cpu" and not spec.metrics.peak_flops_per_device:
        measured = cpu_peak.process_peak()
    return core_flops.peak_flops(spec, kind, local_cpus, measured)


def param_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
