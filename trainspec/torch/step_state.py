"""A wrapped step's state as its checkpoints and replica checks see it (a part of
trainspec.torch.step.WrappedStep): the local blocks a checkpoint carries, the replica
fingerprints compared across the data axes, and save and restore through TorchCheckpointer."""
from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from trainspec.core.collectives_reference import to_groups
from trainspec.core.health import ReplicaMismatch, odd_copies
from trainspec.torch.checkpoint import TorchCheckpointer
from trainspec.torch.guard import DeviceGuard
from trainspec.torch.layout import local_block
from trainspec.torch.runtime import fingerprint


class CheckpointedState:
    """WrappedStep's checkpoints and replica checks; it reads the step's model, params,
    optimizer, reduction, outer step, guard, mesh and data axes."""

    def state_tensors(self) -> list[torch.Tensor]:
        """This rank's blocks of everything its checkpoints carry: the parameters, the
        optimizer's state, the error-feedback residual and semi_sync's anchor and momentum."""
        optimizer = [v for per_param in self.optimizer.state.values() for v in per_param.values()
                     if torch.is_tensor(v)]
        compressed = self.reduction.compressed if self.reduction is not None else None
        residual = [compressed.residual] if compressed and compressed.residual is not None else []
        outer = [*self.outer.anchor, *self.outer.momentum] if self.outer is not None else []
        return [local_block(t) for t in (*self.params, *optimizer, *residual, *outer)]

    def check_replicas(self, step: int, last_good_step: int = 0,
                       ids: list[int] | None = None) -> None:
        """Fingerprint every parameter's local block; the copies across the data axes must
        agree. ReplicaMismatch names the first parameter whose copies differ and the ranks the
        core's majority vote finds odd in any data group: the fingerprints are gathered from
        every rank, so that every rank raises the same (a rollback re-forms the job on all).
        `ids[rank]`: how to name a rank (default: by its rank; a run names the ranks of the
        job as launched)."""
        if self.data_group is None:
            return
        # under [semi_sync] the groups agree on the anchor (their own parameters differ
        # between outer steps)
        blocks = self.outer.anchor if self.outer else [local_block(q.detach()) for q in self.params]
        mine = [fingerprint(block) for block in blocks]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        names = [name for name, _ in self.model.named_parameters()]
        odd, first = set(), None
        for ranks in self._data_groups():
            for i, name in enumerate(names):
                diverged = odd_copies([struct.pack("<II", *every[r][i]) for r in ranks])
                if diverged:
                    odd.update(ranks[j] for j in diverged)
                    first = first or name
                    break
        if odd:
            named = sorted(ids[r] if ids else r for r in odd)
            raise ReplicaMismatch(f"replica fingerprints differ after step {step}: {first} on "
                                  f"ranks {named}", last_good_step, named)

    def _data_groups(self) -> list[list[int]]:
        """The global ranks of each data group (the copies of the same blocks)."""
        grid = self.mesh.mesh.numpy()
        names = list(self.mesh.mesh_dim_names)
        members, _ = to_groups(grid, grid.ndim, tuple(names.index(a) for a in self.data_axes))
        return members.tolist()

    def save(self, checkpointer: TorchCheckpointer, step: int) -> None:
        """Checkpoint the state after `step` (its data position), replicas checked first."""
        self.check_replicas(step, checkpointer.last_saved or 0)
        counts = self.guard.counts()
        checkpointer.save(step, self.model, self.optimizer, self.total_steps, self.updates,
                          counts["skipped_steps"], self.mesh_shape,
                          counts["consecutive_nonfinite"], outer=self.outer)

    def restore(self, checkpointer: TorchCheckpointer) -> int:
        """Load the newest checkpoint, resharded onto this layout (any mesh); the data position
        to continue from (0 when there is none). The schedule keeps the saved run's length."""
        meta = checkpointer.restore_latest(self.model, self.optimizer, self.outer)
        if meta is None:
            return 0
        if self.outer is not None:
            self.outer.steps_done = meta["data_position"]
        self.total_steps, self.updates = meta["total_steps"], meta["updates"]
        self.guard = DeviceGuard(self.spec.health.nan, self.device, meta["data_position"],
                                 meta["skipped_steps"], meta.get("consecutive_nonfinite", 0))
        return meta["data_position"]
