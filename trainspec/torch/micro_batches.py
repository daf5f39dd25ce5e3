"""The micro-batch loops of a wrapped step (a part of trainspec.torch.step.WrappedStep): the
gradients of the summed token losses accumulated over `batch.accumulation_steps` micro-batches
of this rank's rows, under the precision policy's autocast, and `[eval]`'s held-out loss over
the same rows without a gradient."""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from trainspec.torch.models.moe import routing_stats, weighted_aux_loss
from trainspec.torch.step_inputs import check_loss, local_rows


class MicroBatches:
    """WrappedStep's forward and backward passes; it reads the step's model, loss_fn, spec,
    rows, pipeline, reductions and noise scale."""

    def _accumulate(self, batch: Mapping) -> tuple[torch.Tensor, dict]:
        """Gradients of the summed token losses over k micro-batches (rows j, j+k, ... of this
        rank's rows); (loss sum, valid tokens) of this rank, and the MoE layers' routing
        statistics summed over the micro-batches ({} without experts). With MoE layers
        (trainspec.torch.models.moe) their auxiliary losses join the loss sum."""
        k = self.spec.batch.accumulation_steps
        local = self._local_rows(batch)
        sums = torch.zeros(2, dtype=torch.float32, device=self.device)
        every = self.noise_scale.every_micro_batch
        routing: dict = {}
        for j in range(k):
            micro = {key: v[j::k] for key, v in local.items()}
            if self.pipeline is not None:  # forwards and backwards by the stages' schedule
                with self._compute():
                    loss_sum, tokens = self.pipeline.run(micro)
                sums += torch.stack([loss_sum, tokens])
                continue
            if self.fsdp:  # reduce-scatter once, after the last micro-batch (or after each)
                self.model.set_requires_gradient_sync(every or j == k - 1)
            if self.overlapped is not None and j == k - 1:  # this backward completes them
                self.overlapped.arm()
            with self._compute():
                loss_sum, tokens = self._loss(micro)
                stats = routing_stats(self.model)
                if stats is not None:
                    loss_sum = loss_sum + weighted_aux_loss(self.model, tokens)
                    routing = {n: routing.get(n, 0) + v for n, v in stats.items()}
            loss_sum.backward()
            tokens = torch.as_tensor(tokens, device=self.device).float()
            sums += torch.stack([loss_sum.detach().float(), tokens])
            if every:
                self.noise_scale.after_micro_batch(
                    [q.grad for q in self.params if q.grad is not None], tokens)
        return sums, routing

    def evaluate(self, batch: Mapping) -> tuple[float, float]:
        """(loss sum, valid tokens) of `loss_fn` over the global batch (this rank's rows, or the
        whole batch), the model in eval mode, no gradient: `[eval]`'s held-out loss."""
        k, local = self.spec.batch.accumulation_steps, self._local_rows(batch)
        sums = torch.zeros(2, dtype=torch.float32, device=self.device)
        self.model.eval()
        try:
            with torch.no_grad():
                for j in range(k):
                    micro = {key: v[j::k] for key, v in local.items()}
                    with self._compute():
                        if self.pipeline is not None:
                            loss_sum, tokens = self.pipeline.evaluate(micro)
                        else:
                            loss_sum, tokens = self.loss_fn(self.model, micro)
                        if routing_stats(self.model) is not None:
                            loss_sum = loss_sum + weighted_aux_loss(self.model, tokens)
                    tokens = torch.as_tensor(tokens, device=self.device).float()
                    sums += torch.stack([loss_sum.float(), tokens])
        finally:
            self.model.train()
        if self.batch_group is not None:
            dist.all_reduce(sums, group=self.batch_group)
        loss_sum, tokens = sums.tolist()
        return loss_sum, tokens

    def _compute(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _loss(self, micro: dict):
        result = self.loss_fn(self.model, micro)
        if not self._loss_checked:
            check_loss(result)
            self._loss_checked = True
        return result

    def _local_rows(self, batch: Mapping) -> dict[str, torch.Tensor]:
        local = local_rows(batch, self.spec.batch.global_batch, self._rows, self.device)
        return local if self.context is None else self.context.local(local)
