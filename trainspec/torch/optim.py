"""The spec's `[optimizer]` on torch: the update rule, the learning-rate schedule and gradient
clipping, as trainspec.jax.train.make_optimizer builds them with optax."""
from __future__ import annotations

import math

import torch

from trainspec.core.spec import OptimizerSpec


def learning_rate(o: OptimizerSpec, total_steps: int, count: int) -> float:
    """The learning rate of update number `count` (0-based): linear warm-up from 0, then cosine
    decay to a tenth, exactly the schedule trainspec.jax.train.make_optimizer builds with optax."""
    warmup = min(o.warmup_steps, total_steps - 1)
    decay = max(total_steps, 2)
    if count < warmup:
        return o.learning_rate * count / warmup
    alpha = 0.1
    t = min(count - warmup, decay - warmup) / (decay - warmup)
    return o.learning_rate * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * t)) + alpha)


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
