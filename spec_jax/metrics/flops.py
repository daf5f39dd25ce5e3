"""Model FLOPs (analytic, convention named), XLA's own count, and the peak-FLOPs table.

Conventions (docs/metrics.md): a multiply-add is 2 FLOPs; a training step is forward + backward
= 3 x forward for weight matmuls (6 N per token); every token position of the batch counts,
padding included (as torchtitan and MaxText). The attention term is 12 L d T per token with no
causal discount (torchtitan) or half that with it (MaxText).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from spec_jax.spec import ModelSpec, Spec, load_spec

CONVENTIONS = ("no_causal_discount", "causal_discount")


@dataclasses.dataclass(frozen=True)
class TransformerFlops:
    """Analytic FLOPs of the reference decoder (spec_jax.models.transformer) per token."""

    model: ModelSpec
    seq_len: int
    remat: str = "none"

    @property
    def embedding_params(self) -> int:
        return self.model.vocab_size * self.model.d_model

    @property
    def block_matmul_params(self) -> int:
        d, f = self.model.d_model, self.model.d_ff
        return 4 * d * d + 2 * d * f  # q, k, v, out; mlp_in, mlp_out

    @property
    def non_embedding_params(self) -> int:
        """All parameters except the input embedding table: blocks, norms, output head."""
        m = self.model
        norms = (2 * m.n_layers + 1) * m.d_model
        return m.n_layers * self.block_matmul_params + norms + m.d_model * m.vocab_size

    @property
    def total_params(self) -> int:
        return self.non_embedding_params + self.embedding_params

    def attention_per_token(self, convention: str) -> float:
        """Scores (Q K^T) and weighted values (A V): 2 matmuls of 2 d T FLOPs each, x3 for
        forward + backward, per layer; halved under the causal discount."""
        full = 12.0 * self.model.n_layers * self.model.d_model * self.seq_len
        return full / 2 if convention == "causal_discount" else full

    def model_per_token(self, convention: str = "no_causal_discount") -> float:
        if convention not in CONVENTIONS:
            raise ValueError(f"unknown FLOPs convention {convention!r}")
        return 6.0 * self.non_embedding_params + self.attention_per_token(convention)

    def hardware_per_token(self) -> float:
        """What this implementation executes in matmuls: the model FLOPs without discount
        (the masked attention computes every score), minus the norm scales (elementwise), plus
        the one-hot embedding matmul (forward 2 V d, weight gradient 2 V d) and the forward
        recomputed by rematerialisation."""
        m = self.model
        matmul_params = m.n_layers * self.block_matmul_params + m.d_model * m.vocab_size
        flops = 6.0 * matmul_params + self.attention_per_token("no_causal_discount")
        flops += 4.0 * m.vocab_size * m.d_model
        return flops + self.remat_per_token()

    def remat_per_token(self) -> float:
        m = self.model
        attn_fwd = 4.0 * m.d_model * self.seq_len  # scores + weighted values, forward
        if self.remat == "full":
            # The backward needs every block activation except the MLP output, so jax recomputes
            # the forward up to mlp_in: q, k, v, out, mlp_in projections and attention.
            return m.n_layers * (2.0 * (4 * m.d_model**2 + m.d_model * m.d_ff) + attn_fwd)
        if self.remat == "dots_with_no_batch_dims_saveable":
            return m.n_layers * attn_fwd  # attention einsums have batch dims: recomputed
        return 0.0  # none, dots_saveable: every matmul output is kept


def for_spec(spec: Spec) -> TransformerFlops:
    return TransformerFlops(spec.model, spec.batch.seq_len, spec.remat.policy)


def tokens_per_step(spec: Spec) -> int:
    """Token positions per optimizer step, padding included (the FLOPs count them all)."""
    return spec.batch.global_batch * spec.batch.seq_len


def xla_flops_per_step(wrapped_step, state, batch) -> float | None:
    """XLA's cost analysis of the step as lowered (whole program, before SPMD partitioning).

    XLA's cost analysis counts a while-loop body once, whatever its trip count, so a step that
    accumulates micro-batches (a loop) is lowered again with one micro-batch of the whole
    global batch: the same arithmetic without the loop. Lowering compiles nothing.
    Returns None where the backend gives no cost analysis.
    """
    from spec_jax.step import wrap

    spec = wrapped_step.spec
    if spec.batch.accumulation_steps > 1:
        flat = load_spec(spec, [f"batch.micro_batch={spec.batch.global_batch}"])
        step = wrap(wrapped_step.step_fn, flat, wrapped_step.mesh)
        step.state_pspecs, step.state_shardings = wrapped_step.state_pspecs, wrapped_step.state_shardings
    else:
        step = wrapped_step
    cost = step.lower(state, batch).cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per program
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


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


def peak_flops(spec: Spec, devices=None) -> Peak:
    """Peak FLOP/s of one device: the spec's override, else the table, else unknown (None)."""
    if spec.metrics.peak_flops_per_device:
        return Peak(spec.metrics.peak_flops_per_device, "spec:metrics.peak_flops_per_device")
    devices = devices if devices is not None else jax.devices()
    kind = devices[0].device_kind
    key = device_kind_key(kind)
    if key == "cpu":
        local = max(1, sum(1 for d in jax.local_devices() if d.platform == "cpu"))
        return Peak(CPU_PROCESS_PEAK_FLOPS / local,
                    f"table:cpu float32 measured {CPU_PROCESS_PEAK_FLOPS:.3g}/{local} devices")
    if key is None:
        return Peak(None, f"unknown device kind {kind!r}: set metrics.peak_flops_per_device")
    return Peak(PEAK_FLOPS_BF16[key], f"table:{key} bfloat16 dense")


def utilisation(flops_per_step: float | None, step_time_s: float | None, n_devices: int,
                peak: Peak) -> float | None:
    """flops / (time x devices x peak); None when any factor is unknown."""
    if not flops_per_step or not step_time_s or not peak.flops_per_device:
        return None
    return float(flops_per_step / (step_time_s * n_devices * peak.flops_per_device))


def param_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
