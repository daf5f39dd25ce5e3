"""`remat.policy` on torch: activation checkpointing of a model's units (docs/adapters.md).

The spec's policies name JAX's checkpoint policies, which decide per saved value whether the
backward pass keeps it or recomputes it from the unit's input. Torch decides the same per
operator with selective activation checkpointing (torch.utils.checkpoint's `context_fn`):

- `full`: keep only each unit's inputs and recompute all of it (JAX's `nothing_saveable`);
- `dots_saveable`: keep the outputs of matrix products and recompute the rest. A product is a
  matmul (`mm`, `addmm`, `bmm`, `baddbmm`) or the fused attention of
  F.scaled_dot_product_attention, whose saved output and log-sum-exp stand for JAX's two
  attention products (the fused kernel never materialises the scores);
- `dots_with_no_batch_dims_saveable`: keep only products without batch dimensions: the 2-D
  matmuls that nn.Linear lowers to (`mm`, `addmm`); batched matmuls and the fused attention are
  recomputed, as JAX recomputes its attention einsums.

The units are the modules FSDP2 shards (trainspec.torch.layout.shard_units: by default the
children of the outermost nn.ModuleLists, the repeated blocks), as the reference JAX model
checkpoints each block. torch's composable `checkpoint` hooks the module without renaming its
parameters, so checkpoints and tensor-parallel plans see the same names.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainspec.core.errors import UserInputError

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default})  # no batch dimensions
BATCHED_MATMULS = frozenset({aten.bmm.default, aten.baddbmm.default})
FUSED_ATTENTION = frozenset(
    getattr(aten, name).default for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"))
SAVED = {
    "full": frozenset(),
    "dots_saveable": MATMULS | BATCHED_MATMULS | FUSED_ATTENTION,
    "dots_with_no_batch_dims_saveable": MATMULS,
}


def _policy(saved: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def apply_remat(model: nn.Module, units: Sequence[str], policy: str) -> None:
    """Checkpoint every unit under `policy` (a value of remat.policy); "none" does nothing.
    Call before fully_shard, so that FSDP2's all-gather runs outside the recomputed region."""
    if policy == "none":
        return
    if not units:
        raise UserInputError(
            f"remat.policy: {policy!r} checkpoints each repeated block, and the model has no "
            "nn.ModuleList to take them from; name them with fsdp_units, or use none")
    from torch.distributed._composable import checkpoint

    saved = SAVED[policy]
    context_fn = None
    if saved:
        context_fn = functools.partial(create_selective_checkpoint_contexts,
                                       functools.partial(_policy, saved))
    for name in units:
        checkpoint(model.get_submodule(name), context_fn=context_fn)
