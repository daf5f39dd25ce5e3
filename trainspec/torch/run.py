"""A wrapped torch step in the run loop (its engine: trainspec.torch.engine): `TorchRunCheckpointer`
over its checkpoints, and `Run`, the run services for a user's own loop on torch:

    step = trainspec.torch.wrap(model_fn, loss_fn, spec)
    with trainspec.torch.Run(spec, "runs/mine", step, steps=100) as run:
        state = run.resume()                      # newest checkpoint loaded into the step, or as built
        for batch in run.batches(batch_at):       # batch_at(i): this rank's rows of batch i
            state, metrics = run.step(state, batch)
            state = run.after_step(state, metrics)
    print(run.summary())

`run.step(state, batch)` is the wrapped step with the run's non-finite guard deciding each
update (`step(rows, apply)`), so that the guard's counts travel with the run's checkpoints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainspec.core import flops
from trainspec.core import run as core_run
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.checkpoint import TorchCheckpointer
from trainspec.torch.engine import TorchEngine
from trainspec.torch.step import WrappedStep

class TorchRunCheckpointer:
    """trainspec.core.loop.Checkpointer over TorchCheckpointer: the state is a torch step; its
    applied-update count and skipped steps travel in the checkpoint's meta."""

    def __init__(self, spec, run_dir: Path, writer: bool):
        self.files = TorchCheckpointer(spec, Path(run_dir), writer)
        self.directory, self.writer = self.files.directory, writer

    @property
    def last_saved(self) -> int | None:
        return self.files.last_saved

    @property
    def enabled(self) -> bool:
        return self.files.interval > 0

    def due(self, step: int, last_step: int) -> bool:
        return self.files.due(step, last_step)

    def rejoined(self, writer: bool) -> None:
        """The job was re-formed (trainspec.torch.members): whether this rank writes now; the
        background saves' group is made again in the new job."""
        self.writer = writer
        self.files.rejoined(writer)

    def save(self, step: int, state, total_steps: int, health: dict) -> None:
        self.files.save(step, state.model, state.optimizer, total_steps, state.updates,
                        health["skipped_steps"], state.mesh_shape,
                        health["consecutive_nonfinite"], health.get("skipped_batches", []),
                        state.outer)

    def wait(self) -> None:
        """Block until the last save is complete (`checkpoint.async_save`: written behind)."""
        self.files.wait()

    def restore_latest(self, target) -> tuple[Any, dict | None]:
        meta = self.files.restore_latest(target.model, target.optimizer, target.outer)
        if meta is None:
            return None, None
        target.total_steps, target.updates = meta["total_steps"], meta["updates"]
        return target, {**meta, "health": {
            "skipped_steps": meta["skipped_steps"],
            "consecutive_nonfinite": meta.get("consecutive_nonfinite", 0),
            "skipped_batches": meta.get("skipped_batches", [])}}

    def saved_total_steps(self) -> int | None:
        return self.files.saved_total_steps()

    def set_aside(self) -> list[Path]:
        """Move every checkpoint into `<dir>-quarantine/` (rank 0; the others wait)."""
        return self.files.set_aside()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        """Nothing is held between saves."""


class Run(core_run.Run):
    """The run services (trainspec.core.run.Run) for a user's own loop around `step`, a
    `trainspec.torch.wrap` step of this rank, in the job it joined: checkpoints in
    `run_dir`, the spec's metrics sinks, progress, summary. `steps` defaults to `train.steps`;
    `model_flops` fills the records' MFU. Other options as trainspec.core.run.Run."""

    def __init__(self, spec, run_dir, step: WrappedStep, steps: int | None = None, *,
                 model_flops: flops.ModelFlops | None = None, **options):
        adapter = TorchRuntime(spec.collectives.timeout_s)  # the job the step joined
        super().__init__(spec, run_dir, TorchRunCheckpointer(spec, run_dir, adapter.is_writer()),
                         steps or spec.train.steps, **options)
        self.torch_step = TorchEngine(step, adapter, model_flops)

    def _resume_job(self, init_fn=None, *args):
        """`resume(init_fn=None, *args)`: the step, with the newest checkpoint loaded into it
        (resharded onto its layout), or, when there is none, as it was built, after
        `init_fn(model, *args)` (when given) set its model's parameters in place, without
        gradients (the model as the step holds it: sharded parameters are DTensors)."""
        step = self.torch_step.job

        def init():
            if init_fn is not None:
                with torch.no_grad():
                    init_fn(step.model, *args)
            return step

        return self.torch_step, step, init
