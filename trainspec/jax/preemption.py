"""Stop on SIGTERM or SIGINT at a step boundary with a checkpoint, as orbax and MaxText do on
preemption: finish the current step, write a checkpoint on every process, wait for it, say
where it is, and exit with the conventional status (128 + signal: 143, 130).

In one process the signal sets a flag that the loop reads after each step. Across processes
every rank must save at the same step, and a rank learns of a signal only locally: jax's
preemption sync manager (started by `jax.distributed.initialize`) catches SIGTERM itself and
agrees on the step with the other processes through the coordination service, so there the
loop asks `reached_preemption_sync_point(step)` after every step (a local call; no
collective unless a notice arrived). `trainspec launch` turns SIGINT into SIGTERM for its ranks.
"""
from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils


class Preempted(Exception):
    """Raised by the loop after the checkpoint a stop signal asked for is complete."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopSignals:
    """While entered: note SIGTERM/SIGINT instead of dying; `due(step)` says when to stop."""

    def __init__(self):
        self.received: int | None = None
        self._across_processes = jax.process_count() > 1
        self._previous: dict[int, object] = {}

    def _note(self, signum, _frame) -> None:
        self.received = signum

    def __enter__(self):
        # Across processes SIGTERM belongs to jax's preemption notifier (see above); Python
        # lets only the main thread install handlers.
        in_main = threading.current_thread() is threading.main_thread()
        signums = (signal.SIGTERM, signal.SIGINT) if in_main and not self._across_processes else ()
        for signum in signums:
            self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def due(self, step: int) -> int | None:
        """The signal to stop for after `step` (the same step on every process), or None."""
        if self._across_processes:
            return signal.SIGTERM if multihost_utils.reached_preemption_sync_point(step) else None
        return self.received
