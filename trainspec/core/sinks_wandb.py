"""The `wandb` sink (`metrics.sinks = ["wandb"]`, the `wandb` extra): every record's numbers
logged to a Weights & Biases run under TensorBoard's tags (trainspec.core.sinks.TaggedScalars),
the spec as the run's config. Offline unless WANDB_MODE says otherwise: the run is written under
RUN_DIR/wandb, and `wandb sync` uploads it later (a training job need not reach a server).

Importing this module imports wandb, so naming the sink without the package is refused when the
spec is checked, before the run writes anything (trainspec.core.sinks.registered_sink).
"""
from __future__ import annotations

import os
from pathlib import Path

import wandb

from trainspec.core.sinks import TaggedScalars

# The run's id, kept so that a resume (append) continues the same W&B run.
RUN_ID_FILE = "trainspec_run_id"


class WandbSink:
    def __init__(self, spec, run_dir: Path, append: bool):
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "wandb" / RUN_ID_FILE
        run_id = id_file.read_text().strip() if append and id_file.is_file() else None
        self._run = wandb.init(  # id None: a new run, with an id W&B makes
            dir=str(run_dir), id=run_id, resume="allow", name=run_dir.resolve().name,
            project=os.environ.get("WANDB_PROJECT", "trainspec"),
            mode=os.environ.get("WANDB_MODE", "offline"), config=spec.to_dict(),
            reinit="create_new",  # its own run, whatever else this process logs to W&B
            settings=wandb.Settings(silent=True, console="off"))  # the progress bar stays whole
        id_file.write_text(self._run.id)
        # Our step is the x-axis: the points of steps redone after a resume or rollback are
        # logged again at their step (W&B's own step only grows)
        self._run.define_metric("step", hidden=True)
        self._run.define_metric("*", step_metric="step")
        self._tagged = TaggedScalars()

    def write(self, record: dict) -> None:
        scalars, facts = self._tagged(record)
        if facts is not None:
            self._run.config.update({"facts": facts}, allow_val_change=True)
        self._run.log({"step": record["step"], **scalars})

    def rewind(self, step: int) -> dict[int, float]:
        return {}  # W&B's history is append-only; the redone steps are logged again

    def close(self) -> None:
        self._run.finish()


def make(spec, run_dir: Path, append: bool) -> WandbSink:
    return WandbSink(spec, Path(run_dir), append)
