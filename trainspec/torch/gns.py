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
        parts = now if self._previous is None else torch._foreach_sub(now, self._previous)
        self._micro.append((self.norms.local_squares(grads, parts), tokens.float()))
        self._previous = [b.detach().clone() for b in now]

    def _micro_small(self) -> tuple[torch.Tensor, torch.Tensor]:
        squares = {axes: torch.stack([s[axes] for s, _ in self._micro])
                   for axes in self._micro[0][0]}
        tokens = torch.stack([t for _, t in self._micro])
        if self.replica_group is not None:
            dist.all_reduce(tokens, group=self.replica_group)
        per_micro = self.norms.total(squares) / tokens.clamp(min=1.0).pow(2)
        self._micro, self._previous = [], None
        return per_micro.sum().double() / self.k, tokens.sum().double() / self.k

    # -- over replicas -----------------------------------------------------------------------
    def replica_part(self, grads: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor | None:
        """This replica's (|G_r|^2, B_r) from its gradient sum (before the data all-reduce) and
        this rank's tokens, to be summed over the data group (None unless measured over
        replicas)."""
        if self.source != REPLICAS:
            return None
        tokens = tokens.float()
        if self.replica_group is not None:  # a copy: the step's own count stays this rank's
            tokens = tokens.reshape(1).clone()
            dist.all_reduce(tokens, group=self.replica_group)
            tokens = tokens[0]
        tokens = tokens.clamp(min=1.0)
        square = self.norms.total(self.norms.local_squares(grads))
        return torch.stack([square / tokens ** 2, tokens])

    def small_batch(self, summed: torch.Tensor | None = None) -> tuple | None:
        """The small batch's (|G_small|^2, B_small) as float64 tensors; None when nothing is
        measured. Over replicas, from the replica parts summed over the data group."""
        if self.source == REPLICAS:
            small_sq, b_small = (summed / self.replicas).double()
            return small_sq, b_small
        if self.source == MICRO_BATCHES:
            return self._micro_small()
        return None

    @staticmethod
    def parts(small: tuple | None, grad_norm: torch.Tensor,
              tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step's `gns_grad_sq` and `gns_trace` (float64, on the device) from the small
        batch and the big one (the whole batch: its mean gradient's norm and valid tokens);
        one batch size gives values that are not finite."""
        if small is None:
            return {}
        small_sq, b_small = small
        grad_sq, trace = unbiased_parts(small_sq, grad_norm.double() ** 2, b_small,
                                        tokens.double())
        return {"gns_grad_sq": grad_sq, "gns_trace": trace}
