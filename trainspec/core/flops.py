"""FLOPs conventions, the peak-FLOPs table and the utilisation formula (docs/metrics.md).

Conventions: a multiply-add is 2 FLOPs; a training step is forward + backward = 3 x forward for
weight matmuls (6 N per token); every token position of the batch counts, padding included (as
torchtitan and MaxText). The attention term is 12 L d T per token with no causal discount
(torchtitan) or half that with it (MaxText). A model's own formula lives beside the model
(trainspec.core.transformer_flops for the reference transformer).
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

from trainspec.core.spec import Spec

CONVENTIONS = ("no_causal_discount", "causal_discount")


class ModelFlops(Protocol):
    """What a model's analytic FLOPs formula provides (per token position of a step)."""

    def model_per_token(self, convention: str) -> float: ...

    def hardware_per_token(self) -> float: ...


def tokens_per_step(spec: Spec) -> int:
    """Token positions per optimizer step, padding included (the FLOPs count them all)."""
    return spec.batch.global_batch * spec.batch.seq_len


# -- peaks ----------------------------------------------------------------------------------------
# Dense (no sparsity) peak FLOP/s per device (GPU) or chip (TPU), vendor datasheets, 16-bit
# floating point (bf16; fp16 is the same on these parts). Used for every compute dtype: MFU of a
# float32 run is its share of the chip's bf16 capacity (the record names the source).
PEAK_FLOPS_BF16 = {
    "H100": 989e12,    # H100 SXM5; PCIe parts are lower (756e12): override in the spec
    "H200": 989e12,    # H200 SXM: same tensor cores as H100 SXM
    "A100": 312e12,
    "MI300X": 1307.4e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
}
# Measured on the development machine by bench/cpu_matmul_peak.py (docs/metrics.md says how):
# float32 matmul FLOP/s of the whole process (all cores), shared by the simulated CPU devices.
CPU_PROCESS_PEAK_FLOPS = 1.46e11  # 2-core x86_64, jax 0.10.2, 2048^2: see docs/metrics.md


def device_kind_key(kind: str) -> str | None:
    k = kind.lower()
    if "tpu" in k:
        if "lite" in k or "v5e" in k:
            return "TPU v5e"
        if "v5p" in k or k.strip() == "tpu v5":
            return "TPU v5p"
        return None
    for name in ("H200", "H100", "A100", "MI300X"):
        if name.lower() in k:
            return name
    return "cpu" if k == "cpu" else None


@dataclasses.dataclass(frozen=True)
class Peak:
    flops_per_device: float | None
    source: str


def utilisation(flops_per_step: float | None, step_time_s: float | None, n_devices: int,
                peak: Peak) -> float | None:
    """flops / (time x devices x peak); None when any factor is unknown."""
    if not flops_per_step or not step_time_s or not peak.flops_per_device:
        return None
    return float(flops_per_step / (step_time_s * n_devices * peak.flops_per_device))


def peak_flops(spec: Spec, device_kind: str, cpu_devices_in_process: int = 1,
               cpu_process_peak: Peak | None = None) -> Peak:
    """Peak FLOP/s of one device: the spec's override, else the table, else unknown (None).

    A CPU's peak is the whole process's, shared by its `cpu_devices_in_process`: this machine's
    when the implementation measured it (`cpu_process_peak`), else the table's, which was
    measured on another machine and says so.
    """
    if spec.metrics.peak_flops_per_device:
        return Peak(spec.metrics.peak_flops_per_device, "spec:metrics.peak_flops_per_device")
    key = device_kind_key(device_kind)
    if key == "cpu":
        local = max(1, cpu_devices_in_process)
        if cpu_process_peak is not None and cpu_process_peak.flops_per_device:
            return Peak(cpu_process_peak.flops_per_device / local,
                        f"{cpu_process_peak.source}; shared by {local} devices")
        return Peak(CPU_PROCESS_PEAK_FLOPS / local,
                    f"table:cpu {CPU_PROCESS_PEAK_FLOPS:.3g} float32 measured on the 2-core "
                    f"development machine, not this one; shared by {local} devices")
    if key is None:
        return Peak(None, f"unknown device kind {device_kind!r}: set metrics.peak_flops_per_device")
    return Peak(PEAK_FLOPS_BF16[key], f"table:{key} bfloat16 dense")
