"""Where records go. JSONL always; TensorBoard when a writer (tensorboardX or torch) is installed.

A sink is any object with `write(record: dict)`, `rewind(step)` and `close()`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from spec_jax.errors import UserInputError


class Sink(Protocol):
    def write(self, record: dict) -> None: ...
    def rewind(self, step: int) -> dict[int, float]:
        """Forget records past `step` (work about to be redone after a resume or rollback);
        returns the losses of the records kept, by step."""
    def close(self) -> None: ...


class JsonlSink:
    """One record per line, flushed per record: a crash loses at most the line being written
    (a reader skips a truncated last line: spec_jax.metrics.report.read_jsonl)."""

    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # Always append mode, so that writes follow a `rewind`; a new run starts empty.
        self._file = open(path, "a")
        if not append:
            self._file.truncate(0)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def rewind(self, step: int) -> dict[int, float]:
        """Cut the file after the last record at or before `step`, in place: the file is open
        in append mode, so the next record is written at the new end."""
        kept, losses = 0, {}
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # a line torn by a kill: drop it and what follows
                    break
                if record.get("step", 0) > step:
                    break
                kept += len(line)
                if record.get("loss") is not None:
                    losses[record["step"]] = record["loss"]
        os.truncate(self.path, kept)
        return losses

    def close(self) -> None:
        self._file.close()


def _summary_writer_class():
    try:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    except ImportError:
        pass
    try:
        from torch.utils.tensorboard import SummaryWriter
        return SummaryWriter
    except ImportError:
        return None


class TensorBoardSink:
    """Every numeric field as a scalar `trainspec/<field>` at the record's step."""

    def __init__(self, logdir: Path):
        writer = _summary_writer_class()
        if writer is None:
            raise UserInputError(
                "metrics.tensorboard: no TensorBoard writer installed (pip install tensorboardX)")
        self._writer = writer(str(logdir))

    def write(self, record: dict) -> None:
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self._writer.add_scalar(f"trainspec/{key}", value, record["step"])

    def rewind(self, step: int) -> dict[int, float]:
        return {}  # event files are append-only; viewers show the redone steps' newer values

    def close(self) -> None:
        self._writer.close()


def sinks_for(spec, run_dir: Path, append: bool = False) -> list[Sink]:
    from spec_jax.distributed import is_writer

    if not is_writer():  # one writer per job (process 0): every process computes the records
        return []
    sinks: list[Sink] = [JsonlSink(run_dir / spec.metrics.path, append)]
    if spec.metrics.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    return sinks
