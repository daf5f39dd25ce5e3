"""The training loop of every implementation, and the two small protocols that fill it.

    with Run(spec, run_dir, checkpointer, steps) as run:     # trainspec.core.run
        state = run.resume(step, target, init)               # newest good checkpoint, or init()
        for batch in run.batches(data):                      # from the resume point to `steps`
            state, metrics = step(state, batch)
            state = run.after_step(state, metrics)           # records, fingerprints, checkpoints
    summary = run.summary()

`train` below is that loop; `trainspec train` runs it on either framework, and a user's own
loop is the same few lines around its own step (docs/wrapping.md, docs/adapters.md). An
implementation provides a `Step` (its step and state, as the run sees them) and a
`Checkpointer`; everything else (resume, records, the non-finite guard's reading, replica
fingerprints, stragglers, checkpoints, stop signals, fault injection, progress, goodput, the
summary) is trainspec.core.run's, once.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class Step(Protocol):
    """An implementation's train step as the run uses it (trainspec.jax.run.JaxStep,
    trainspec.torch.run.TorchRunStep). `state` is the implementation's own: a pytree, or a
    module with its optimizer."""

    framework: str             # "jax", "torch": named in records and summaries
    spec: Any                  # the spec it runs (after any exclusion of devices)
    mesh_shape: dict[str, int]
    gns_note: str | None       # why the gradient noise scale is not measured (None: it is)

    def __call__(self, state, batch) -> tuple[Any, dict]: ...

    # -- records: the step's metrics reach the host only here (trainspec.core.recorder) -------
    def facts(self, state, batch) -> dict:
        """The record's static fields (FLOPs, peak, memory, communication, compile time),
        measured once for this step on this batch's shapes (it may compile the step)."""

    def per_record(self) -> dict:
        """Fields measured afresh at every record (live memory)."""

    def to_host(self, tree) -> Any:
        """The tree's values as host numbers: a record's one synchronisation."""

    def combine_metrics(self, metrics: dict) -> dict:
        """The whole step's values from host metrics (semi_sync groups combined)."""

    def learning_rate(self, updates: int) -> float | None:
        """The schedule's rate for update number `updates` (0-based); None when unknown."""

    def summary_fields(self) -> dict:
        """Fields of the implementation's own for the run summary."""

    # -- health --------------------------------------------------------------------------------
    def reset_guard(self, step: int, skipped: int, consecutive: int) -> None:
        """Start the non-finite guard `step` steps in, with a checkpoint's counts."""

    def check_nonfinite(self) -> int:
        """Raise HealthHalt if the non-finite guard tripped; else the steps it skipped."""

    def nonfinite_counts(self) -> dict[str, int]:
        """The guard's counts to checkpoint with the state."""

    def verdict_inputs(self, metrics) -> Any:
        """What judges this step under health.nan.policy = rollback (its loss and gradient
        norm, not yet read: no sync); None when the step carries no guard."""

    def read_verdicts(self, inputs: list) -> list[tuple[bool, float | None]]:
        """(the gradient norm finite, the loss) on the host for each of several steps'
        `inputs`, in one read: the verdicts are due in batches (bad_steps.PendingVerdicts)."""

    def state_is_finite(self, state) -> bool:
        """Every floating element of the state finite, the same answer on every process: run
        before each checkpoint and at the end (trainspec.core.run), not per step."""

    def check_replicas(self, state, step: int, last_good_step: int | None) -> None:
        """Raise ReplicaMismatch naming the copies that differ from their majority."""

    def corrupt(self, state, target: int):
        """Fault injection: `state` with one bit flipped in `target`'s (device or rank) copy."""

    def finish(self, state) -> None:
        """Wait for the step's work to be done (asynchronous dispatch)."""

    # -- the job's processes ---------------------------------------------------------------
    is_writer: bool            # writes the run's files (process 0)
    process_index: int
    participants: list[str]    # the processes whose step times are compared (stragglers)
    local_signals: bool        # whether the loop catches SIGTERM/SIGINT in this process

    def gather_times(self, local: np.ndarray) -> np.ndarray:
        """Every process's step times (processes x steps) from this process's `local` ones."""

    def stop_signal(self, step: int, received: int | None) -> int | None:
        """The signal to stop for after `step`, the same on every process (`received`: the
        one this process caught, if any)."""


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
        state = run.resume(step, target, init)
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
