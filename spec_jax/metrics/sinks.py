"""Where records go. JSONL always; TensorBoard when a writer (tensorboardX or torch) is installed.

A sink is any object with `write(record: dict)` and `close()`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from spec_jax.errors import UserInputError


class Sink(Protocol):
    def write(self, record: dict) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One record per line, flushed per record: a crash loses at most the line being written
    (a reader skips a truncated last line: spec_jax.metrics.report.read_jsonl)."""

    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a" if append else "w")  # append: a resumed run

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

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
