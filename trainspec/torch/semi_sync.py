"""`[semi_sync]` (DiLoCo) on torch: docs/communication.md, as trainspec/jax/semi_sync.py.

Every data group (one index along the data axes) steps its own copy of the model with the inner
optimizer on its rows of each batch; the wrapped step (trainspec/torch/step.py) then sums
the loss, tokens and gradients over the group's own fsdp/tensor ranks only, so nothing crosses
the data axes between outer steps. After every step that is a multiple of H the outer step
averages the groups' parameter deltas `anchor - params` over the data group (one packed float32
all-reduce) and takes one SGD step with Nesterov momentum from the anchor
(m = mu m + d; anchor -= lr (d + mu m)); every group continues from the new anchor, with its
own inner optimizer state. The step count follows the run's data position, so a resume
mid-round continues the round.

A checkpoint holds every group's model and optimizer state under its group's index, and the
anchor and momentum once (trainspec/torch/checkpoint.py), so a resume on the same number of
groups continues bit for bit; another number is refused by name.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from trainspec.core.errors import UserInputError
from trainspec.core.spec import SemiSyncSpec
from trainspec.torch.layout import local_block
from trainspec.torch.optimizer_state import laid_out_like
from trainspec.torch.reduction import packed


class OuterStep:
    """The anchor (in the parameters' dtype) and outer momentum (float32) of this rank's
    blocks of `params`, and the outer step over the data `group`."""

    def __init__(self, settings: SemiSyncSpec, params: list[torch.Tensor], group):
        self.settings, self.params, self.group = settings, params, group
        self.groups = dist.get_world_size(group)
        self.anchor = [local_block(p.detach()).clone() for p in params]
        self.momentum = [torch.zeros_like(a, dtype=torch.float32) for a in self.anchor]
        self.steps_done = 0  # the run's data position: set by a resume

    def exchange(self) -> tuple[str, int, tuple[int, ...]]:
        """The outer step's one collective as the communication count names it (kind, payload
        bytes, the data group's ranks): the packed float32 all-reduce of the deltas."""
        size = 4 * sum(a.numel() for a in self.anchor)
        return "all-reduce", size, tuple(dist.get_process_group_ranks(self.group))

    @property
    def group_index(self) -> int:
        """This rank's data group (its index along the data axes)."""
        return dist.get_rank(self.group)

    def after_inner_step(self) -> None:
        """Count the step; the outer step after each multiple of H."""
        self.steps_done += 1
        if self.steps_done % self.settings.inner_steps == 0:
            self.step()

    def step(self) -> None:
        s = self.settings
        blocks = [local_block(p.detach()) for p in self.params]
        deltas = [a.float() - b.float() for a, b in zip(self.anchor, blocks)]
        packed(deltas, lambda flat: dist.all_reduce(flat, group=self.group))
        for anchor, delta, momentum, block in zip(self.anchor, deltas, self.momentum, blocks):
            mean = delta / self.groups
            momentum.mul_(s.outer_momentum).add_(mean)
            anchor.copy_(anchor.float() - s.outer_lr * (mean + s.outer_momentum * momentum))
            block.copy_(anchor)

    # -- checkpoints ----------------------------------------------------------------------------
    def state(self, named: list[tuple[str, torch.Tensor]]) -> dict:
        """{"anchor": {name: ...}, "momentum": {name: ...}} laid out like the parameters."""
        return {key: {name: laid_out_like(p, block) for (name, p), block in zip(named, blocks)}
                for key, blocks in (("anchor", self.anchor), ("momentum", self.momentum))}

    def load(self, state: dict, named: list[tuple[str, torch.Tensor]]) -> None:
        for key, blocks in (("anchor", self.anchor), ("momentum", self.momentum)):
            for (name, _), block in zip(named, blocks):
                block.copy_(local_block(state[key][name]))

    def check_groups(self, saved: int | None, where) -> None:
        if saved != self.groups:
            raise UserInputError(
                f"semi_sync: the checkpoint in {where} holds {saved} data groups' states, the "
                f"mesh gives {self.groups}; resume on {saved} data groups, or use another "
                "--run-dir")
