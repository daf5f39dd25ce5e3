"""Per-device memory of one step: the step's arguments and the largest of its phases.

What each phase holds was read off XLA's buffer assignment of the compiled step (docs/plan.md).
What a micro-batch keeps for its backward pass depends on the compiler: the accelerator
profiles count what the backward needs (transformer.token_activations), the CPU profile what
XLA:CPU keeps (plan.xla_cpu).
"""
from __future__ import annotations

from trainspec.core.mesh import ParallelDims
from trainspec.core.plan import xla_cpu
from trainspec.core.plan.comm import guard_meets, regathered_by_remat
from trainspec.core.plan.hardware import Profile
from trainspec.core.plan.sequence_experts import local_tokens
from trainspec.core.plan.shards import (
    DTYPE_BYTES, Stage, local_elements, optimizer_elements, shares)
from trainspec.core.plan.transformer import token_activations
from trainspec.core.spec import Spec

OPTIMIZER_COPIES = {"adamw": 2, "sgd": 1}  # mu and nu; momentum (in the parameter dtype)
BATCH_BYTES_PER_TOKEN = 12  # int32 inputs, targets and mask

# The step's inputs, live throughout; semi_sync's also hold the anchor and the outer momentum
ARGUMENTS = ("params", "optimizer", "batch", "outer_state")
# What the step holds besides its arguments, phase by phase; the peak is the largest phase.
PHASES = {
    # a micro-batch's forward and backward: the gradient accumulator, the weights as the
    # matmuls use them (fsdp-gathered once, before the micro-batch loop) and the activations
    "micro_batches": ("gradients", "weights_in_use", "activations"),
    # fsdp > 1 on XLA:CPU, at the end of each micro-batch: its gradient, whole, and the output
    # of the all-reduce that stands for the reduce-scatter (then sliced)
    "fsdp_reduction": ("gradients", "gathered_params", "unreduced_gradient",
                       "reduce_scatter_output"),
    # after the loop, data > 1: the local gradient and its all-reduced copy
    "data_reduction": ("gradients", "data_reduction_buffer"),
    # the update: the new parameters and optimizer state whole beside the old; under
    # `health.nan.policy` skip or halt the NaN guard chooses between them after both exist and
    # copies the chosen state out leaf by leaf (at most the largest leaf at once)
    "update": ("new_state", "kept_state_copy"),
}


def peak_phase(mem: dict[str, float]) -> str:
    return max(PHASES, key=lambda phase: sum(mem[k] for k in PHASES[phase]))


def memory(spec: Spec, layout: ParallelDims, profile: Profile, stage: Stage | None = None,
           microbatches: int = 1, in_flight: float = 1.0) -> dict[str, float]:
    """Bytes per device of each part of `ARGUMENTS` and `PHASES`, and "total": the arguments
    and the largest phase (the buffers of one phase are dead in the others, and XLA reuses
    their memory), the phase times the heap's slack on XLA:CPU. With a pipeline, of one
    `stage`: its parameters, and the activations of `in_flight` of the `microbatches` each
    micro-batch is split into (plan.pipeline)."""
    pb, gb, cb = (DTYPE_BYTES[spec.precision.param], DTYPE_BYTES[spec.precision.grad_reduce],
                  DTYPE_BYTES[spec.precision.compute])
    local = local_elements(spec, layout, stage=stage)
    fsdp_axes = layout.split("fsdp")
    gathered = local_elements(spec, layout, skip=fsdp_axes, stage=stage)
    data = layout.split("data")
    cpu = profile.backend == "XLA:CPU"
    whole_reduction = bool(fsdp_axes) and profile.reduce_scatter_as_all_reduce
    out = {
        "params": local * pb,
        "optimizer": OPTIMIZER_COPIES[spec.optimizer.name] * optimizer_elements(spec, layout, stage) * pb,
        # semi_sync: the anchor (as the parameters) and the outer momentum (float32)
        "outer_state": local * (pb + 4) if spec.semi_sync is not None else 0.0,
        # the accumulator; XLA:CPU makes none for a single micro-batch
        "gradients": local * gb if spec.batch.accumulation_steps > 1 or not cpu else 0.0,
        "gathered_params": gathered * cb if fsdp_axes else 0.0,
        # XLA:CPU reduces the micro-batch's whole gradient in one all-reduce, then slices; a
        # real reduce-scatter (GPU, TPU) takes each weight's gradient as it is produced and
        # writes its shard into the accumulator
        "unreduced_gradient": gathered * gb if whole_reduction else 0.0,
        "reduce_scatter_output": gathered * gb if whole_reduction else 0.0,
        # the data reduction packs the local gradient into one buffer
        "data_reduction_buffer": local * gb if data else 0.0,
        "batch": local_tokens(spec, layout) * spec.batch.accumulation_steps
        * BATCH_BYTES_PER_TOKEN,
    }
    out["new_state"] = out["params"] + out["optimizer"]
    out["kept_state_copy"] = (max(s.elements for s in shares(spec, layout, stage=stage)) * pb
                              if guard_meets(spec) else 0.0)
    tokens = local_tokens(spec, layout, microbatches) * in_flight
    tensor = layout.tensor
    if cpu:
        # XLA:CPU gathers float32 weights (a 16-bit parameter converted first)
        out["gathered_params"] = gathered * 4 if fsdp_axes else 0.0
        again = sum(s.elements for s in shares(spec, layout, skip=fsdp_axes)
                    if fsdp_axes and regathered_by_remat(s.param, spec))
        out["weights_in_use"] = xla_cpu.weight_bytes(spec, gathered, again, bool(fsdp_axes))
        out["activations"] = tokens * xla_cpu.activation_bytes(
            spec.model, spec.batch.seq_len, tensor, spec.precision.compute, bool(fsdp_axes),
            layout.size_of(layout.split("context")), spec.context.attention)
    else:
        out["weights_in_use"] = out["gathered_params"]
        per_token = token_activations(
            spec.model, spec.batch.seq_len, spec.remat.policy, profile.fused_attention,
            *((len(stage.layers), stage.first, stage.last) if stage else ()))
        out["activations"] = tokens * cb * (per_token.replicated + per_token.split / tensor)
    slack = xla_cpu.HEAP_SLACK if cpu else 1.0
    out["total"] = (sum(out[k] for k in ARGUMENTS)
                    + slack * sum(out[k] for k in PHASES[peak_phase(out)]))
    return out
