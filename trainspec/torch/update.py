"""A step's update, decided on the device: the schedule's learning rate picked by the update
count there, global-norm clipping decided there, and the optimizer stepped where the step's
verdict (`take`, a bool tensor) says so, with nothing read on the host.

The spec's optimizers are torch's fused AdamW and SGD (trainspec/torch/optim.py), whose kernels
take the verdict as `found_inf` and skip the whole update (parameters, moments, step count) on
the device. Read on the host instead: the verdict of the first update (fused SGD would keep an
uninitialised momentum from a skipped first step; the first step is always recorded anyway)
and of every update of an optimizer without such a kernel (one `optimizer_fn` builds), whose
rate is then set as a number.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor.experimental import implicit_replication

from trainspec.core.reference_train import learning_rate
from trainspec.core.spec import OptimizerSpec
from trainspec.torch.optim import clip_by_global_norm, schedule_table


class DeviceUpdate:
    """The updates of `optimizer` (or a split one's `inner`); `settings`: the spec's schedule
    and clipping, None where the optimizer keeps its own rate and nothing is clipped."""

    def __init__(self, optimizer: torch.optim.Optimizer, settings: OptimizerSpec | None,
                 device: torch.device):
        self.optimizer, self.settings = optimizer, settings
        # applied updates, the schedule's count (a skipped step adds none)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self._table: tuple[int, torch.Tensor] | None = None  # (total steps, rates)

    def learning_rate(self, updates: int, total_steps: int) -> float:
        """The rate of update `updates` (a host number)."""
        if self.settings is not None:
            return learning_rate(self.settings, total_steps, updates)
        return float(self.optimizer.param_groups[0]["lr"])

    def _rate(self, total_steps: int) -> torch.Tensor:
        if self._table is None or self._table[0] != total_steps:
            self._table = (total_steps, schedule_table(
                self.settings, total_steps, self.count.device))
        rates = self._table[1]
        # take, not indexing: a tensor index is read on the host (a sync per step on a GPU)
        return rates.take(self.count.clamp(max=rates.numel() - 1))

    def _on_device(self) -> torch.optim.Optimizer | None:
        """The optimizer that takes the verdict as `found_inf`, or None."""
        inner = getattr(self.optimizer, "inner", self.optimizer)  # a split optimizer's own
        fused = inner.defaults.get("fused") and getattr(inner, "_step_supports_amp_scaling", False)
        return inner if fused and inner.state else None

    def __call__(self, blocks: list[torch.Tensor], grad_norm: torch.Tensor, take: torch.Tensor,
                 total_steps: int):
        """Clip the gradients' local `blocks` by `grad_norm`, set the rate and step where
        `take`; returns the step's rate (a tensor, or a number where read on the host)."""
        fused = self._on_device()
        if fused is None and not bool(take):  # the host decides: nothing to do
            return self.learning_rate(int(self.count), total_steps)
        if self.settings is None:
            lr = self.learning_rate(0, total_steps)
        else:
            lr = self._rate(total_steps)
            clip_by_global_norm(blocks, grad_norm, self.settings.grad_clip_norm)
            for group in self.optimizer.param_groups:  # a skipped step changes no state
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].copy_(torch.where(take, lr, group["lr"]))
                else:  # an optimizer that takes a number
                    group["lr"] = float(lr)
        if fused is not None:  # the fused kernels skip the update where found_inf is 1
            fused.found_inf = (~take).float()
        # the rate and found_inf are plain tensors beside DTensor parameters: replicated
        with implicit_replication():
            self.optimizer.step()
        self.count += take.long()
        return lr
