"""`metrics.gns` on torch: the gradient noise scale's two batch sizes inside the step, as the JAX
step measures them (trainspec/jax/metrics/gns.py; the estimator: trainspec/core/gns.py).

- over replicas (data axes split): each replica's gradient sum before the data all-reduce is the
  small batch (B_small: its valid tokens), the reduced one the big batch. |G_small|^2 is the
  mean over replicas of |sum_r / tokens_r|^2;
- over micro-batches (one replica, accumulation): each micro-batch's gradient is the small
  batch. Under fsdp the step then reduce-scatters every micro-batch (the gradient of one
  micro-batch is otherwise never whole), and keeps the previous sum of this rank's shard to
  take each micro-batch's part as the difference.

The step's metrics carry the per-step parts `gns_grad_sq` and `gns_trace`; the run estimates
the current noise scale from the recent steps' parts (trainspec.core.gns.NoiseScale).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from trainspec.core.gns import MICRO_BATCHES, REPLICAS, resolve, unbiased_parts
from trainspec.torch.layout import local_block
from trainspec.torch.norms import Norms


class StepNoiseScale:
    """What one rank adds to the step for metrics.gns. `source`: REPLICAS, MICRO_BATCHES or
    None (then `note` says why nothing is measured)."""

    def __init__(self, setting: bool | None, replicas: int, micro_batches: int, norms: Norms,
                 data_group, replica_group):
        self.source, self.note = resolve(setting, replicas, micro_batches, True)
        self.norms, self.replicas, self.k = norms, replicas, micro_batches
        self.data_group, self.replica_group = data_group, replica_group  # replica: its batch shards
        self._micro: list[tuple[dict, torch.Tensor]] = []
        self._previous: list[torch.Tensor] | None = None

    @property
    def every_micro_batch(self) -> bool:
        """Whether gradients must be reduced (fsdp) after every micro-batch."""
        return self.source == MICRO_BATCHES

    # -- over micro-batches ----------------------------------------------------------------
    def after_micro_batch(self, grads: list[torch.Tensor], tokens: torch.Tensor) -> None:
        """After micro-batch j's backward: the squares of its gradient (this rank's blocks of
        the summed gradient, less the sum before it) and this rank's valid tokens in it."""
        now = [local_block(g) for g in grads]
        parts = now if self._previous is None else [b - p for b, p in zip(now, self._previous)]
        self._micro.append((self.norms.local_squares(grads, parts), tokens.float()))
        self._previous = [b.detach().clone() for b in now]

    def _micro_small(self) -> tuple[float, float]:
        squares = {axes: torch.stack([s[axes] for s, _ in self._micro])
                   for axes in self._micro[0][0]}
        tokens = torch.stack([t for _, t in self._micro])
        if self.replica_group is not None:
            dist.all_reduce(tokens, group=self.replica_group)
        per_micro = self.norms.total(squares) / tokens.clamp(min=1.0).pow(2)
        self._micro, self._previous = [], None
        return float(per_micro.sum()) / self.k, float(tokens.sum()) / self.k

    # -- over replicas -----------------------------------------------------------------------
    def _replica_small(self, grads: list[torch.Tensor],
                       tokens: torch.Tensor) -> tuple[float, float]:
        """From this replica's gradient sum (before the data all-reduce) and this rank's
        tokens: (mean over replicas of |G_r|^2, mean replica batch in tokens)."""
        tokens = tokens.float().reshape(1).clone()
        if self.replica_group is not None:
            dist.all_reduce(tokens, group=self.replica_group)
        tokens = tokens.clamp(min=1.0)
        square = self.norms.total(self.norms.local_squares(grads))
        both = torch.stack([square / tokens[0] ** 2, tokens[0]])
        dist.all_reduce(both, group=self.data_group)
        small_sq, b_small = (both / self.replicas).tolist()
        return small_sq, b_small

    def small_batch(self, grads: list[torch.Tensor], tokens: torch.Tensor) -> tuple | None:
        """The small batch's (|G_small|^2, B_small), before the data all-reduce; None when
        nothing is measured."""
        if self.source == REPLICAS:
            return self._replica_small(grads, tokens)
        if self.source == MICRO_BATCHES:
            return self._micro_small()
        return None

    @staticmethod
    def parts(small: tuple | None, grad_norm: float, tokens: float) -> dict[str, float]:
        """The step's `gns_grad_sq` and `gns_trace` from the small batch and the big one (the
        whole batch: its mean gradient's norm and valid tokens)."""
        if small is None:
            return {}
        small_sq, b_small = (np.float64(v) for v in small)
        with np.errstate(divide="ignore", invalid="ignore"):  # one batch size: not finite
            grad_sq, trace = unbiased_parts(small_sq, np.float64(grad_norm) ** 2, b_small,
                                            np.float64(tokens))
        return {"gns_grad_sq": float(grad_sq), "gns_trace": float(trace)}

