"""Where records go. JSONL always (spec_jax.core.records.JsonlWriter); TensorBoard when a
writer (tensorboardX or torch) is installed.

A sink is any object with `write(record: dict)`, `rewind(step)` and `close()`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from spec_jax.core.errors import UserInputError
from spec_jax.core.records import JsonlWriter
from spec_jax.distributed import is_writer


class Sink(Protocol):
    def write(self, record: dict) -> None: ...
    def rewind(self, step: int) -> dict[int, float]:
        """Forget records past `step` (work about to be redone after a resume or rollback);
        returns the losses of the records kept, by step."""
    def close(self) -> None: ...


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
    if not is_writer():  # one writer per job (process 0): every process computes the records
        return []
    sinks: list[Sink] = [JsonlWriter(run_dir / spec.metrics.path, append)]
    if spec.metrics.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    return sinks
