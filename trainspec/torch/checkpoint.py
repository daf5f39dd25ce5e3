"""Checkpoints of the torch implementation through torch.distributed.checkpoint (DCP).

Any model and optimizer: the reference job's (trainspec/torch/train.py) or a user's
(trainspec.torch.wrap's `save`/`restore`).

Layout: `<run_dir>/<checkpoint.dir>/<step>/` holds DCP's files and `meta.json` (step, data
position, applied updates, the run's length, the non-finite guard's counts, the spec, every
parameter's global shape). A save writes
`<step>.partial/` and rank 0 renames it to `<step>/` after every rank finished, so a kill -9
mid-save leaves no directory that looks complete. Under `checkpoint.async_save` the save is
DCP's `async_save`: the state is copied to host memory (staged) and the step returns while a
background thread writes it over a process group of its own; the same thread then waits for
every rank's shards and rank 0 marks it complete (meta, rename). `wait()` blocks until then; the
next save, a restore and the end of the run wait first. Model and optimizer state go through
`get_state_dict`/`set_state_dict`: DCP stores every shard with its global offsets, so a
checkpoint restores onto another world size or layout (FSDP2 and DTensor reshard on load).
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec
from trainspec.core.run_files import refuse_foreign_checkpoints
from trainspec.torch.background_save import BackgroundSave
from trainspec.torch.semi_sync import OuterStep

FORMAT = "trainspec.torch/1"
META = "meta.json"


class TorchCheckpointer:
    """Checkpoints of one run directory; `writer` (default: rank 0) writes the meta and renames.
    Saves in the background under `checkpoint.async_save`: `wait()` before another object
    reads them."""

    def __init__(self, spec: Spec, run_dir: Path, writer: bool | None = None):
        self.spec = spec
        self.writer = dist.get_rank() == 0 if writer is None else writer
        self.directory = run_dir / spec.checkpoint.dir
        self.interval, self.keep = spec.checkpoint.interval, spec.checkpoint.keep
        self.last_saved: int | None = None
        self._pending: BackgroundSave | None = None
        self._group = None  # the background saves' own process group, made at the first one

    def due(self, step: int, last_step: int) -> bool:
        return self.interval > 0 and (step % self.interval == 0 or step == last_step)

    # -- what is on disk -----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Complete checkpoints, newest first. A directory without our meta is refused by
        name: another implementation's checkpoints must not be taken for ours."""
        if not self.directory.is_dir():
            return []
        refuse_foreign_checkpoints(self.directory, "torch")
        found = []
        for path in self.directory.iterdir():
            if not path.name.isdigit():
                continue
            meta = self._meta(path)
            if meta.get("format") != FORMAT:
                raise UserInputError(
                    f"checkpoint.dir: {path} is not a checkpoint of the torch implementation "
                    f"(format {meta.get('format')!r}); give this run another --run-dir")
            found.append(int(path.name))
        return sorted(found, reverse=True)

    @staticmethod
    def _meta(path: Path) -> dict:
        try:
            return json.loads((path / META).read_text())
        except (OSError, ValueError):
            return {}

    def saved_total_steps(self) -> int | None:
        steps = self.steps()
        return self._meta(self.directory / str(steps[0]))["total_steps"] if steps else None

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
        self.wait()  # one save at a time: the previous one complete and marked first
        partial = self.directory / f"{step}.partial"
        if self.writer and partial.exists():
            shutil.rmtree(partial)  # left by a killed save
        dist.barrier()
        state = _state(model, optimizer, outer)
        meta = {"format": FORMAT, "step": step, "data_position": step, "updates": updates,
                "total_steps": total_steps, "skipped_steps": skipped_steps,
                "consecutive_nonfinite": consecutive_nonfinite,
                "skipped_batches": list(skipped_batches),
                "spec": self.spec.to_dict(), "mesh": mesh, "parameters": _shapes(model),
                **({"semi_sync_groups": outer.groups} if outer else {})}
        complete = self._completion(partial, step, meta)
        if self.spec.checkpoint.async_save:
            self._pending = BackgroundSave(state, partial, self._save_group(), complete)
        else:
            dcp.save(state, checkpoint_id=str(partial))
            complete(None)
        self.last_saved = step

    def _completion(self, partial: Path, step: int, meta: dict) -> Callable:
        """What makes a written checkpoint good, once every rank's shards are on disk: rank 0
        writes the meta and renames `<step>.partial` to `<step>`, the others wait for it
        (over `group`: the default one, or the background saves' own)."""
        def complete(group) -> None:
            dist.barrier(group=group)  # every rank's shards are written
            if self.writer:
                (partial / META).write_text(json.dumps(meta, indent=2))
                final = self.directory / str(step)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(partial, final)
                for old in self.steps()[self.keep:]:
                    shutil.rmtree(self.directory / str(old))
            dist.barrier(group=group)
        return complete

    def _save_group(self):
        """A gloo group of every rank for the background saves: their collectives must not
        interleave with the training step's on the default group (and DCP's async save needs
        a CPU backend where the default one is NCCL)."""
        if self._group is None:
            timeout = datetime.timedelta(seconds=self.spec.collectives.timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def forget_groups(self) -> None:
        """The job was re-formed: the background saves' group is gone with the old job."""
        self._group = None

    def wait(self) -> None:
        """Block until the last save is complete (written and marked); a background save's
        error is raised here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def restore_latest(self, model, optimizer, outer: OuterStep | None = None) -> dict | None:
        """Load the newest checkpoint into `model`/`optimizer` (resharded onto their layout)
        and `outer` (under [semi_sync]: this rank's group's state); its meta, or None when
        there is none."""
        self.wait()
        steps = self.steps()
        if not steps:
            return None
        path = self.directory / str(steps[0])
        meta = self._meta(path)
        _check_same_model(meta["spec"], self.spec, path)
        _check_same_shapes(meta.get("parameters"), _shapes(model), path)
        groups = meta.get("semi_sync_groups")
        if outer is not None or groups is not None:
            if outer is None:
                raise UserInputError(f"semi_sync: the checkpoint in {path} was written under "
                                     "[semi_sync]; resume it with the same table")
            outer.check_groups(groups, path)
        state = _state(model, optimizer, outer)
        dcp.load(state, checkpoint_id=str(path))
        inner = state if outer is None else state["groups"][str(outer.group_index)]
        set_state_dict(model, optimizer, model_state_dict=inner["model"],
                       optim_state_dict=inner["optim"])
        if outer is not None:
            outer.load(state["outer"], list(model.named_parameters()))
        self.last_saved = steps[0]
        return meta


def _state(model, optimizer, outer: OuterStep | None) -> dict:
    """What DCP saves and loads: the model's and optimizer's state dicts; under [semi_sync]
    under this rank's group's index (the groups' states differ between outer steps, and DCP
    keeps one copy of what ranks hold alike), with the outer state beside them."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if outer is None:
        return state
    return {"groups": {str(outer.group_index): state},
            "outer": outer.state(list(model.named_parameters()))}


def _check_same_model(saved: dict, spec: Spec, where: Path) -> None:
    """The parts of the spec a checkpoint's arrays depend on must not have changed: the model,
    its precision and optimizer, and whether the state holds an error-feedback residual."""
    current = spec.to_dict()
    for section in ("model", "precision", "optimizer"):
        if saved.get(section) != current[section]:
            raise UserInputError(
                f"{section}: differs from the checkpoint in {where} ({saved.get(section)} there, "
                f"{current[section]} now); use another --run-dir")
    keys = ("compression", "error_feedback") if spec.collectives.compression != "none" else (
        "compression",)  # without a compression, error_feedback changes nothing
    for key in keys:
        was, now = saved["collectives"][key], current["collectives"][key]
        if was != now:
            raise UserInputError(
                f"collectives.{key}: the checkpoints in {where} were written with {was!r}, the "
                f"spec says {now!r}; use another --run-dir, or the saved value")


def _shapes(model) -> dict[str, list[int]]:
    """Every parameter's global shape (a DTensor's shape is the whole parameter's)."""
    return {name: list(p.shape) for name, p in model.named_parameters()}


def _check_same_shapes(saved: dict | None, current: dict, where: Path) -> None:
    """The model must have the checkpoint's parameters: DCP would fail on the first missing
    one with a traceback, or load a resized one partially."""
    if saved is None:  # a meta without shapes: DCP's own checks only
        return
    for name in sorted(saved.keys() | current.keys()):
        if saved.get(name) != current.get(name):
            there = saved.get(name, "absent")
            here = current.get(name, "absent")
            raise UserInputError(
                f"model: parameter {name} is {here} here and {there} in the checkpoint in "
                f"{where}; restore it into the model that saved it, or use another run directory")
