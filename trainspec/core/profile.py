"""Profiler traces of chosen steps (`[profile]`, docs/spec.md): the run loop starts the
implementation's profiler (jax.profiler, torch.profiler) on one process right before step
`start_step` and stops it after step `start_step + steps - 1`, the step's queued work
finished first, writing the trace into RUN_DIR/profile/ (docs/spec.md, `profile`)."""
from __future__ import annotations

from pathlib import Path

from trainspec.core.backend import Engine, JobProcesses, Tracing
from trainspec.core.errors import UserInputError

DIRECTORY = "profile"


class TraceWindow:
    """The steps this process traces, and whether its profiler is running."""

    def __init__(self, spec, run_dir: Path, step: JobProcesses):
        p = spec.profile
        if p.start_step and p.process >= len(step.participants):
            raise UserInputError(f"profile.process: {p.process}, but the job has "
                                 f"{len(step.participants)} processes")
        self.first, self.last = p.start_step, p.start_step + p.steps - 1
        self.here = bool(p.start_step) and step.process_index == p.process
        self.directory = Path(run_dir) / DIRECTORY
        self.running = False

    def before_step(self, at: int, step: Tracing) -> None:
        if self.here and at == self.first:
            self.directory.mkdir(parents=True, exist_ok=True)
            step.start_trace(self.directory)
            self.running = True

    def after_step(self, at: int, step: Engine, state) -> None:
        """Stops the trace after its last step (or at the end of the run, `at` None)."""
        if self.running and (at is None or at >= self.last):
            step.finish(state)  # the traced steps' queued work belongs in the trace
            step.stop_trace()
            self.running = False
