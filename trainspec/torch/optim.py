"""The spec's `[optimizer]` on torch: the update rule and gradient clipping (the learning-rate
schedule is the trunk's, core.reference_train.learning_rate), as optax does it in
trainspec.jax.train.make_optimizer."""
from __future__ import annotations

import torch

from trainspec.core.reference_train import learning_rate
from trainspec.core.spec import OptimizerSpec


def spec_optimizer(o: OptimizerSpec, params) -> torch.optim.Optimizer:
    """The spec's update rule; its learning rate is set before each update (`learning_rate`).
    Fused, its learning rate a tensor: torch's fused kernels take the step's non-finite
    verdict as a tensor (`found_inf`) and skip the update on the device, and read the rate
    there, so that the step never waits for the host to decide."""
    lr = torch.zeros((), dtype=torch.float64)
    if o.name == "adamw":  # optax.adamw's defaults: b1 0.9, b2 0.999, eps 1e-8
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=o.weight_decay, fused=True)
    # optax.sgd(momentum=0.9): no dampening
    return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=True)


def clip_by_global_norm(blocks: list[torch.Tensor], norm: torch.Tensor,
                        max_norm: float | None) -> None:
    """optax.clip_by_global_norm on the gradients' local `blocks`: those whose global `norm`
    (a tensor) is at least `max_norm` are scaled to it (None: no clipping), decided on the
    device. Divided by the norm, then multiplied by max_norm, or both by 1 (exact): the
    numbers of a host-side `if`."""
    if max_norm is None or not blocks:
        return
    clip = norm >= max_norm
    torch._foreach_div_(blocks, torch.where(clip, norm, 1.0))
    torch._foreach_mul_(blocks, torch.where(clip, max_norm, 1.0))


def schedule_table(o: OptimizerSpec, total_steps: int, device: torch.device) -> torch.Tensor:
    """`learning_rate` of every update count 0..total_steps (float64, on `device`): the step
    picks its rate by its update count on the device (a count past the run's end keeps the
    last rate, as the schedule does)."""
    return torch.tensor([learning_rate(o, total_steps, c) for c in range(total_steps + 1)],
                        dtype=torch.float64, device=device)
