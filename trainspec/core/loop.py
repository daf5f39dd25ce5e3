"""The training loop of every backend, and the checkpoints' protocol that fills it.

    with Run(spec, run_dir, checkpointer, steps) as run:     # trainspec.core.run
        state = run.restore(step, target, init)              # newest good checkpoint, or init()
        for batch in run.batches(data):                      # from the resume point to `steps`
            state, metrics = step(state, batch)
            state = run.after_step(state, metrics)           # records, fingerprints, checkpoints
    summary = run.summary()

`train` below is that loop; `trainspec train` runs it on either framework, and a user's own
loop is the same few lines around its own step (docs/wrapping.md, docs/adapters.md). A
backend provides an engine (trainspec.core.backend.Engine: its step and state, as the run
sees them) and a `Checkpointer`; everything else (resume, records, the non-finite guard's reading, replica
fingerprints, stragglers, checkpoints, stop signals, fault injection, progress, goodput, the
summary) is trainspec.core.run's, once.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol



class Checkpointer(Protocol):
    """An implementation's checkpoints of one run directory (trainspec.jax.checkpoint.Checkpointer,
    trainspec.torch.run.TorchRunCheckpointer). A context manager: leaving it releases it."""

    directory: Path
    last_saved: int | None

    @property
    def enabled(self) -> bool: ...

    def due(self, step: int, last_step: int) -> bool: ...

    def save(self, step: int, state, total_steps: int, health: dict) -> None:
        """Start writing `state` as of `step` (the data position); `health`: the guard's counts."""

    def wait(self) -> None:
        """Block until the last save is complete."""

    def restore_latest(self, target) -> tuple[Any, dict | None]:
        """(state, meta) of the newest good checkpoint placed like `target`, or (None, None)."""

    def saved_total_steps(self) -> int | None:
        """The run length the newest checkpoint was planned for (its learning-rate schedule)."""

    def set_aside(self) -> list[Path]:
        """Move every checkpoint aside (kept): the run starts over."""

    def __enter__(self): ...

    def __exit__(self, *exc) -> None: ...


def train(run, build: Callable[[Any], tuple]) -> dict:
    """The loop: resume, then every step from there to the run's `steps`; the summary.
    `build(run)` makes the job, (step, target, init, data), once the run knows the length of
    the schedule to build it for (`run.total_steps`: a resumed run keeps its own)."""
    with run:
        step, target, init, data = build(run)
        state = run.restore(step, target, init)
        for batch in run.batches(data):
            state, metrics = run.step(state, batch)  # the run's step: a rollback may rebuild it
            state = run.after_step(state, metrics)
    return run.summary()


class Preempted(Exception):
    """Raised by the loop after the checkpoint a stop signal asked for is complete."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopSignals:
    """While entered: note SIGTERM/SIGINT instead of dying, to stop at a step boundary with a
    checkpoint (as orbax and MaxText do on preemption). `install=False` where the framework
    catches them itself (jax's preemption notifier across processes); Python lets only the main
    thread install handlers."""

    def __init__(self, install: bool = True):
        self.install = install
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _note(self, signum, _frame) -> None:
        self.received = signum

    def __enter__(self):
        if self.install and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def progress_bar(total: int, enabled: bool, desc: str = "train"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True)
