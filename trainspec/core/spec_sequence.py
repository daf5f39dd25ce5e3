"""The spec's sections for long sequences and mixtures of experts: `[context]` (how a `context`
mesh axis splits the sequence and computes attention across it) and `[model.moe]` (the
reference model's experts, sharded over an `expert` mesh axis), and the checks across them and
the mesh (docs/spec.md).

The checks that need an axis's size are written once over the resolved degrees, so that the
spec's validation (fixed sizes) and the mesh resolution (the `-1` axis resolved,
trainspec.core.mesh) give the same one-line messages.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, model_validator

from trainspec.core.spec_section import Section

CONTEXT_ATTENTION = ("ring", "all_gather")
CONTEXT_SPLITS = ("zigzag", "contiguous")


class ContextSpec(Section):
    """How the `context` mesh axes split each sequence, and how attention sees all of it."""

    attention: Literal[CONTEXT_ATTENTION] = Field(
        "ring", description="`ring`: each rank keeps its query block and the key/value blocks "
        "travel around the context axis, merged by an online softmax (log-sum-exp); "
        "`all_gather`: each rank gathers every key/value block, then attends once.")
    split: Literal[CONTEXT_SPLITS] = Field(
        "zigzag", description="`zigzag`: the sequence is cut into 2n chunks and rank i holds "
        "chunks i and 2n-1-i, so every rank has equal causal work; `contiguous`: rank i holds "
        "chunk i of n.")


class MoESpec(Section):
    """The reference model's mixture of experts: every block's MLP is `experts` MLPs of width
    `model.d_ff`, of which a router picks `top_k` per token."""

    experts: int = Field(..., ge=2, le=2**16, description="Experts per MoE layer.")
    top_k: int = Field(2, ge=1, le=2**16, description="Experts each token is sent to.")
    capacity_factor: float = Field(
        0.0, ge=0, le=2**16, description="Tokens an expert takes per step: capacity_factor x "
        "tokens x top_k / experts, rounded up; the rest are dropped (their expert output is "
        "zero). 0 = dropless (no bound).")
    load_balance_weight: float = Field(
        0.01, ge=0, le=1e3, description="Weight of the Switch Transformer load-balancing loss "
        "experts x sum_e(f_e x P_e) added to the training loss.")
    z_loss_weight: float = Field(
        0.001, ge=0, le=1e3, description="Weight of the ST-MoE router z-loss, the mean over "
        "tokens of logsumexp(router logits)^2, added to the training loss.")

    @model_validator(mode="after")
    def _top_k(self):
        if self.top_k > self.experts:
            raise ValueError(f"top_k {self.top_k} exceeds experts {self.experts}")
        return self


def sequence_and_expert_errors(spec, degrees: Mapping[str, int]) -> list[tuple[str, str]]:
    """(field, message) for each way the `context` and `expert` axes of sizes `degrees`
    (axis -> size; axes missing or of size -1 are not checked) do not fit the spec."""
    errors = []

    def split(role: str) -> tuple[list[str], int]:
        axes = [a for a in spec.mesh.axes_with_role(role) if degrees.get(a, -1) > 1]
        size = 1
        for a in axes:
            size *= degrees[a]
        return axes, size

    context_axes, context = split("context")
    if context_axes:
        chunks = 2 * context if spec.context.split == "zigzag" else context
        if spec.batch.seq_len % chunks:
            errors.append(("batch.seq_len", f"{spec.batch.seq_len} tokens do not split into the "
                           f"{chunks} equal chunks a {spec.context.split} split over context "
                           f"axes {', '.join(context_axes)} (size {context}) needs"))
    expert_axes, expert = split("expert")
    moe = spec.model.moe
    if expert_axes and moe is None:
        errors.append((f"mesh.axes.{expert_axes[0]}", f"an expert axis of size {expert} shards "
                       "experts, but the model has none: add [model.moe]"))
    elif expert_axes and moe.experts % expert:
        errors.append(("model.moe.experts", f"{moe.experts} experts do not split evenly over "
                       f"expert axes {', '.join(expert_axes)} (size {expert})"))
    return errors
