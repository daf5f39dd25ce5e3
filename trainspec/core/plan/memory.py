"""Per-device memory of one step: the step's arguments and the largest of its phases.

What each phase holds is read off XLA's buffer assignment of the compiled step (docs/plan.md);
the activations one token leaves for the backward are trainspec.core.plan.transformer's.
"""
from __future__ import annotations

import dataclasses

from trainspec.core.plan.hardware import Profile
from trainspec.core.plan.shards import (DTYPE_BYTES, Layout, local_elements, optimizer_elements,
                                        role_axes, shares)
from trainspec.core.plan.transformer import token_activations
from trainspec.core.spec import Spec

OPTIMIZER_COPIES = {"adamw": 2, "sgd": 1}  # mu and nu; momentum (in the parameter dtype)
BATCH_BYTES_PER_TOKEN = 12  # int32 inputs, targets and mask

ARGUMENTS = ("params", "optimizer", "batch")  # the step's inputs, live throughout
# What the step holds besides its arguments, phase by phase; the peak is the largest phase.
PHASES = {
    # a micro-batch's forward and backward: the gradient accumulator, the fsdp-gathered
    # parameters (gathered once, before the micro-batch loop) and the activations
    "micro_batches": ("gradients", "gathered_params", "activations"),
    # fsdp > 1 on XLA:CPU, at the end of each micro-batch: its gradient, whole, and the output
    # of the all-reduce that stands for the reduce-scatter (then sliced)
    "fsdp_reduction": ("gradients", "gathered_params", "unreduced_gradient", "reduce_scatter_output"),
    # after the loop, data > 1: the local gradient and its all-reduced copy
    "data_reduction": ("gradients", "data_reduction_buffer"),
    # the update: the NaN guard (health.nan) chooses between the old state and the new after
    # both exist, so the new parameters and optimizer state are whole beside the old, and the
    # chosen state is copied out leaf by leaf (at most the largest leaf at once)
    "update": ("new_state", "kept_state_copy"),
}


def peak_phase(mem: dict[str, float]) -> str:
    return max(PHASES, key=lambda phase: sum(mem[k] for k in PHASES[phase]))


def memory(spec: Spec, layout: Layout, profile: Profile) -> dict[str, float]:
    """Bytes per device of each part of `ARGUMENTS` and `PHASES`, and "total": the arguments
    and the largest phase (the buffers of one phase are dead in the others, and XLA reuses
    their memory).

    Activations are the elements `transformer.token_activations` counts for the tokens one
    device holds in one micro-batch, the part the tensor axis splits and the part it does not
    each times the profile's overhead factor (what the compiler keeps beyond the count: fusion
    temporaries, the backward's own intermediates; 1 on profiles not calibrated)."""
    pb = DTYPE_BYTES[spec.precision.param]
    gb = DTYPE_BYTES[spec.precision.grad_reduce]
    cb = DTYPE_BYTES[spec.precision.compute]
    local = local_elements(spec, layout)
    fsdp_axes = role_axes(spec, layout, "fsdp")
    gathered = local_elements(spec, layout, skip=fsdp_axes)
    copies = OPTIMIZER_COPIES[spec.optimizer.name]
    data = role_axes(spec, layout, "data")
    whole_reduction = bool(fsdp_axes) and profile.reduce_scatter_as_all_reduce
    out = {
        "params": local * pb,
        "optimizer": copies * optimizer_elements(spec, layout) * pb,
        "gradients": local * gb,
        "gathered_params": gathered * cb if fsdp_axes else 0.0,
        # XLA:CPU reduces the micro-batch's whole gradient in one all-reduce, then slices; a
        # real reduce-scatter (GPU, TPU) takes each weight's gradient as it is produced and
        # writes its shard into the accumulator
        "unreduced_gradient": gathered * gb if whole_reduction else 0.0,
        "reduce_scatter_output": gathered * gb if whole_reduction else 0.0,
        # the data reduction packs the local gradient into one buffer
        "data_reduction_buffer": local * gb if data else 0.0,
    }
    out["new_state"] = out["params"] + out["optimizer"]
    out["kept_state_copy"] = max(s.elements for s in shares(spec, layout)) * pb
    tensor = layout.group(role_axes(spec, layout, "tensor"))[0]
    shards = layout.group(role_axes(spec, layout, "fsdp") + data)[0]
    tokens = spec.batch.micro / shards * spec.batch.seq_len
    per_token = token_activations(spec.model, spec.batch.seq_len, spec.remat.policy,
                                  profile.fused_attention)
    out["activations"] = tokens * cb * (
        per_token.replicated * profile.activation_overhead_replicated
        + per_token.split / tensor * profile.activation_overhead)
    out["batch"] = spec.batch.global_batch / shards * spec.batch.seq_len * BATCH_BYTES_PER_TOKEN
    phase = PHASES[peak_phase(out)]
    out["total"] = sum(out[k] for k in ARGUMENTS) + sum(out[k] for k in phase)
    return out


def fit_activation_overheads(spec_layouts, profile: Profile) -> Profile:
    """The profile with both activation overhead factors fitted (least squares) to measured
    per-device memory: `spec_layouts` is [(spec, layout, measured bytes)], two or more, with
    different tensor sizes so that the split and the replicated parts can be told apart, and
    activations large enough that the micro-batch phase is the peak (it is the one fitted)."""
    def micro_batch_peak(spec, layout, split, replicated):
        mem = memory(spec, layout, dataclasses.replace(
            profile, activation_overhead=split, activation_overhead_replicated=replicated))
        return sum(mem[k] for k in ARGUMENTS + PHASES["micro_batches"])

    rows = []
    for spec, layout, measured in spec_layouts:
        base = micro_batch_peak(spec, layout, 0.0, 0.0)
        rows.append((micro_batch_peak(spec, layout, 1.0, 0.0) - base,
                     micro_batch_peak(spec, layout, 0.0, 1.0) - base, measured - base))
    sxx = sum(a * a for a, _, _ in rows)
    syy = sum(b * b for _, b, _ in rows)
    sxy = sum(a * b for a, b, _ in rows)
    sxz = sum(a * z for a, _, z in rows)
    syz = sum(b * z for _, b, z in rows)
    det = sxx * syy - sxy * sxy
    if abs(det) < 1e-12 * max(sxx * syy, 1.0):
        raise ValueError("activation fit needs layouts with different tensor sizes")
    split_f = (sxz * syy - syz * sxy) / det
    rep_f = (syz * sxx - sxz * sxy) / det
    return dataclasses.replace(profile, activation_overhead=split_f,
                               activation_overhead_replicated=rep_f)
