"""Checkpoints of the torch implementation, under the trunk's policy (trainspec.core.store):
the layout (`<step>.partial/` renamed to `<step>/` once complete), the manifest of every file's
size and SHA-256, verification before anything is read, quarantine, fallback to the newest good
checkpoint, and the spec fields a resume must match, are the trunk's. This module moves the
bytes, through trainspec.torch.state_files: safetensors files and JSON, no pickle.

Any model and optimizer: the reference job's (trainspec/torch/train.py) or a user's
(trainspec.torch.wrap's `save`/`restore`). Model and optimizer state go through
`get_state_dict`/`set_state_dict`: every block is stored with its offsets in the whole tensor,
so a checkpoint restores onto another world size or layout. The meta (in the manifest) holds
the step, data position, applied updates, the run's length, the non-finite guard's counts, the
spec and every parameter's global shape.

Under `checkpoint.async_save` the state is copied to host memory (staged) and the step returns
while a background thread writes it; the same thread then waits for every rank's file and rank
0 seals the checkpoint (manifest, rename), over a process group of its own. `wait()` blocks
until then; the next save, a restore and the end of the run wait first.
"""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainspec.core.errors import UserInputError
from trainspec.core.run_files import refuse_foreign_checkpoints
from trainspec.core.spec import Spec
from trainspec.core.store import BadCheckpoint, Checkpoints, agreement, check_compatible, due
from trainspec.torch import state_files
from trainspec.torch.background_save import BackgroundSave
from trainspec.torch.semi_sync import OuterStep

FORMAT = "trainspec.torch/2"  # 2: safetensors blocks under the trunk's manifest


class TorchCheckpointer:
    """Checkpoints of one run directory; `writer` (default: rank 0) seals and moves them.
    Saves in the background under `checkpoint.async_save`: `wait()` before another object
    reads them."""

    def __init__(self, spec: Spec, run_dir: Path, writer: bool | None = None):
        self.spec = spec
        self.writer = dist.get_rank() == 0 if writer is None else writer
        self.store = Checkpoints(Path(run_dir) / spec.checkpoint.dir, writer=self.writer,
                                 sync=dist.barrier, agree=agreement(_all_gather))
        self.store.check_directory()
        self.directory = self.store.directory
        self.interval, self.keep = spec.checkpoint.interval, spec.checkpoint.keep
        self.last_saved: int | None = None
        self._pending: BackgroundSave | None = None
        self._group = None  # the background saves' own process group, made at the first one

    def due(self, step: int, last_step: int) -> bool:
        return due(step, last_step, self.interval)

    def rejoined(self, writer: bool) -> None:
        """The job was re-formed: whether this rank writes now; the background saves' group is
        gone with the old job."""
        self.writer = self.store.writer = writer
        self._group = None

    # -- what is on disk -----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Complete checkpoints (not yet verified), newest first; another implementation's
        are refused by name."""
        refuse_foreign_checkpoints(self.directory, "torch")
        return self.store.steps()

    def saved_total_steps(self) -> int | None:
        """The run length the newest readable checkpoint was planned for (its schedule); a
        spec that cannot resume it is refused here, before anything is written."""
        return self.store.saved_total_steps(self.spec, self.steps())

    def set_aside(self) -> list[Path]:
        """Move every checkpoint into the quarantine (rank 0; the others wait)."""
        return self.store.set_aside(self.steps())

    # -- save and restore -----------------------------------------------------------------------
    def save(self, step: int, model, optimizer, total_steps: int, updates: int,
             skipped_steps: int, mesh: dict[str, int], consecutive_nonfinite: int = 0,
             skipped_batches: list[int] = (), outer: OuterStep | None = None) -> None:
        """Write the state after `step`; `mesh`: the axis sizes it is sharded over;
        `skipped_batches`: the data indices the run leaves out (health.nan.policy = rollback);
        `outer`: under [semi_sync], every group's state under its index, the outer state once.
        Returns once the state is copied under `checkpoint.async_save` (the previous save
        complete)."""
        if self.interval <= 0 or step == self.last_saved:
            return
        self.wait()  # one save at a time: the previous one complete and sealed first
        partial = self.store.partial(step)
        dist.barrier()
        rank = dist.get_rank()
        staged = state_files.stage(_state(model, optimizer, outer), rank, _all_gather)
        meta = {"format": FORMAT, "step": step, "data_position": step, "updates": updates,
                "total_steps": total_steps, "skipped_steps": skipped_steps,
                "consecutive_nonfinite": consecutive_nonfinite,
                "skipped_batches": list(skipped_batches),
                "spec": self.spec.to_dict(), "mesh": mesh, "parameters": _every_shape(model),
                **({"semi_sync_groups": outer.groups} if outer else {})}
        complete = self._completion(step, meta)
        if self.spec.checkpoint.async_save:
            self._pending = BackgroundSave(lambda: staged.write(partial, rank),
                                           self._save_group(), complete)
        else:
            staged.write(partial, rank)
            complete(None)
        self.last_saved = step

    def _completion(self, step: int, meta: dict) -> Callable:
        """What makes a written checkpoint good, once every rank's file is on disk: rank 0
        seals it (manifest, rename), the others wait for it (over `group`: the default one,
        or the background saves' own)."""
        def complete(group) -> None:
            dist.barrier(group=group)  # every rank's file is written
            if self.writer:
                self.store.seal(step, meta, self.keep)
            dist.barrier(group=group)
        return complete

    def _save_group(self):
        """A gloo group of every rank for the background saves: their collectives must not
        interleave with the training step's on the default group (nor run on NCCL)."""
        if self._group is None:
            timeout = datetime.timedelta(seconds=self.spec.collectives.timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def wait(self) -> None:
        """Block until the last save is complete (written and sealed); a background save's
        error is raised here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def restore_latest(self, model, optimizer, outer: OuterStep | None = None) -> dict | None:
        """Load the newest good checkpoint into `model`/`optimizer` (resharded onto their
        layout) and `outer` (under [semi_sync]: this rank's group's state); its meta, or None
        when there is none. The trunk's policy: newer bad ones quarantined, NoGoodCheckpoint
        when none is good."""
        self.wait()
        refuse_foreign_checkpoints(self.directory, "torch")
        meta = self.store.restore_newest(lambda step: self._restore(step, model, optimizer, outer))
        if meta is not None:
            self.last_saved = meta["step"]
        return meta

    def _restore(self, step: int, model, optimizer, outer: OuterStep | None) -> dict:
        manifest = self.store.verified(step)  # nothing is read before it verified
        meta, path = manifest["meta"], self.directory / str(step)
        if meta.get("format") != FORMAT or not isinstance(meta.get("spec"), dict):
            raise BadCheckpoint(f"its meta is not that of a {FORMAT} checkpoint")
        check_compatible(meta["spec"], self.spec, self.directory)
        _check_same_shapes(meta.get("parameters"), _every_shape(model), path)
        groups = meta.get("semi_sync_groups")
        if outer is not None or groups is not None:
            if outer is None:
                raise UserInputError(f"semi_sync: the checkpoint in {path} was written under "
                                     "[semi_sync]; resume it with the same table")
            outer.check_groups(groups, path)
        state = _state(model, optimizer, outer)
        inner = state if outer is None else state["groups"][str(outer.group_index)]
        # each group's parameter names are this rank's, not state: the first file's would name
        # another pipeline stage's parameters, which set_state_dict then finds in no group
        own_params = [list(group["params"]) for group in inner["optim"]["param_groups"]]
        try:
            state_files.read(path, list(manifest["files"]), state)
            why = None
        except BadCheckpoint as err:
            why = str(err)
        why = self.store.agree(why)  # every rank loads it, or none (set_state_dict is collective)
        if why is not None:
            raise BadCheckpoint(why)
        for group, params in zip(inner["optim"]["param_groups"], own_params):
            group["params"] = params
        set_state_dict(model, optimizer, model_state_dict=inner["model"],
                       optim_state_dict=inner["optim"])
        if outer is not None:
            outer.load(state["outer"], list(model.named_parameters()))
        return meta


def _all_gather(mine):
    """Every rank's `mine`, by rank."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _state(model, optimizer, outer: OuterStep | None) -> dict:
    """What a checkpoint holds: the model's and optimizer's state dicts; under [semi_sync]
    under this rank's group's index (the groups' states differ between outer steps, and a
    block is written once by the first rank holding it), with the outer state beside them."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if outer is None:
        return state
    return {"groups": {str(outer.group_index): state},
            "outer": outer.state(list(model.named_parameters()))}


def _every_shape(model) -> dict[str, list[int]]:
    """Every parameter's global shape (a DTensor's shape is the whole parameter's), of every
    rank's model (a pipeline stage's holds some of the parameters)."""
    mine = {name: list(p.shape) for name, p in model.named_parameters()}
    return {name: shape for shapes in _all_gather(mine) for name, shape in shapes.items()}


def _check_same_shapes(saved: dict | None, current: dict, where: Path) -> None:
    """The model must have the checkpoint's parameters, named in one line: the blocks would
    otherwise be found missing (a bad checkpoint) or load a resized one partially."""
    if saved is None:  # a meta without shapes: the blocks' coverage check only
        return
    for name in sorted(saved.keys() | current.keys()):
        if saved.get(name) != current.get(name):
            there = saved.get(name, "absent")
            here = current.get(name, "absent")
            raise UserInputError(
                f"model: parameter {name} is {here} here and {there} in the checkpoint in "
                f"{where}; restore it into the model that saved it, or use another run directory")
