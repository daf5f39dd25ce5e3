"""The step's gradient all-reduce over the data axes: once per step, every trainable parameter's
local block packed into one buffer (as the JAX step fuses them), sent in float32 (or
`precision.grad_reduce`) or compressed with error feedback (`collectives.compression`,
trainspec/torch/compression.py).

The buffer's order is the step's (`order`): by default the model's parameters in
`named_parameters()` order. The residual of error feedback is a float32 buffer in that order;
checkpoints carry it per parameter, laid out like the parameter: the sum of every replica's
residual, which a restore gives to the first replica (what error feedback still owes is the
sum; the JAX checkpoints fold it so onto another replica count).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from trainspec.core.compression import RESIDUAL
from trainspec.core.spec import CollectivesSpec
from trainspec.torch.compression import CompressedSum
from trainspec.torch.layout import local_block
from trainspec.torch.optimizer_state import ExtraState, laid_out_like

# (name, local block) pairs -> the tensors to pack, in order (views of the blocks)
Order = Callable[[list[tuple[str, torch.Tensor]]], list[torch.Tensor]]


def model_order(named: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [block for _, block in named]


class DataReduction:
    """Sums every trainable parameter's gradient over the data `group`."""

    def __init__(self, c: CollectivesSpec, group, grad_dtype: torch.dtype, named_params,
                 order: Order = model_order):
        self.group, self.grad_dtype, self.order = group, grad_dtype, order
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        self.compressed = None
        if c.compression != "none":
            self.compressed = CompressedSum(c.compression, c.compression_block,
                                            c.error_feedback, group)

    def __call__(self) -> None:
        """All-reduce the gradients in place (a parameter without one adds zeros)."""
        blocks = [(n, local_block(p.grad) if p.grad is not None else torch.zeros_like(
            local_block(p))) for n, p in self.named]
        if self.compressed is None:
            packed(self.order(blocks), lambda flat: dist.all_reduce(flat, group=self.group),
                   self.grad_dtype)
        else:
            packed(self.order(blocks), lambda flat: flat.copy_(self.compressed(flat)),
                   torch.float32)

    def commit(self, take: torch.Tensor) -> None:
        """Where the step's update is taken (`take`, a bool tensor), so is its new
        error-feedback residual."""
        if self.compressed is not None:
            self.compressed.commit(take)

    # -- the residual in checkpoints ----------------------------------------------------------
    def residual_state(self) -> ExtraState | None:
        if self.compressed is None or not self.compressed.error_feedback:
            return None
        return ExtraState((RESIDUAL,), self._save_residual, self._load_residual)

    def _blocks(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, torch.zeros_like(local_block(p), dtype=torch.float32)) for n, p in self.named]

    def _save_residual(self) -> dict:
        """{parameter: {RESIDUAL: every replica's residual summed, laid out like it}}."""
        blocks = self._blocks()
        residual = self.compressed.residual
        if residual is not None:
            total = residual.clone()
            dist.all_reduce(total, group=self.group)
            packed(self.order(blocks), lambda flat: flat.copy_(total))
        return {p: {RESIDUAL: laid_out_like(p, block)}
                for (_, p), (_, block) in zip(self.named, blocks)}

    def _load_residual(self, state: dict) -> None:
        """The first replica owes the saved sum; the others start at zero."""
        blocks = [(n, local_block(state[p][RESIDUAL]).float()) for n, p in self.named]
        flat = torch.cat([v.reshape(-1) for v in self.order(blocks)])
        if dist.get_rank(self.group) != 0:
            flat.zero_()
        self.compressed.residual = flat


def packed(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], object],
           dtype: torch.dtype | None = None) -> None:
    """Run `collective` in place on `tensors` packed into one flat buffer (in `dtype`, default
    theirs): one call for all of them, the result copied back."""
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])
    collective(flat)
    offset = 0
    for t in tensors:
        t.detach().copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
