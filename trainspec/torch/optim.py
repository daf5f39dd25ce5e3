"""The spec's `[optimizer]` on torch: the update rule and gradient clipping (the learning-rate
schedule is the trunk's, core.reference_train.learning_rate), as optax does it in
trainspec.jax.train.make_optimizer."""
from __future__ import annotations

import torch

from trainspec.core.spec import OptimizerSpec


def spec_optimizer(o: OptimizerSpec, params) -> torch.optim.Optimizer:
    """The spec's update rule; its learning rate is set before each update (`learning_rate`)."""
    if o.name == "adamw":  # optax.adamw's defaults: b1 0.9, b2 0.999, eps 1e-8
        return torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=o.weight_decay)
    return torch.optim.SGD(params, lr=0.0, momentum=0.9)  # optax.sgd(momentum=0.9): no dampening


def clip_by_global_norm(grads, norm: float, max_norm: float | None) -> None:
    """optax.clip_by_global_norm: gradients whose global norm is at least `max_norm` are scaled
    to it (None: no clipping)."""
    if max_norm is not None and norm >= max_norm:
        for g in grads:
            g.div_(norm).mul_(max_norm)
