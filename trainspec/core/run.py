"""Run: the services of a training run around any loop, for every implementation
(trainspec.core.loop says how a loop uses it; trainspec.jax.Run and trainspec.torch.Run build one
for a step of theirs).

- resume: the newest good checkpoint (or `--restart`: set aside, from step 0), the data position,
  the non-finite guard's counts; a run already at `steps` changes nothing (AlreadyTrained);
- records (trainspec.core.recorder) to the spec's sinks, once per interval, with the learning
  rate, health, the marks of a resume and of a checkpoint; a progress bar; goodput;
- replica fingerprints every `health.fingerprints.interval` steps and before every checkpoint;
  on a mismatch under `rollback`, `roll_back` onto the step `rebuild` makes without the diverged
  devices (where the implementation can), else a halt;
- under `health.nan.policy = rollback`, each step judged a few steps late by its loss and
  gradient norm (trainspec.core.bad_steps: non-finite or a loss spike), and the state itself checked
  before every checkpoint and at the end; on a bad step a rollback to the newest good checkpoint
  that skips the offending batches from then on; on a non-finite state no step showed, a replay
  from that checkpoint that checks every state, to find the step that made it;
- the rollbacks are trainspec.core.run_rollback's (a part of Run kept apart);
- checkpoints when due; after SIGTERM/SIGINT a checkpoint of that step, then Preempted; after a
  guard's halt a checkpoint of the last good state, named in the HealthHalt;
- fault injection (trainspec.core.faults) at the points of the loop it names;
- the summary.
"""
from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trainspec.core import bad_steps, evaluation
from trainspec.core.arrivals import StepMarks
from trainspec.core.faults import Faults
from trainspec.core.goodput import Goodput
from trainspec.core.pipeline.schedule import run_record
from trainspec.core.health import HealthHalt, ReplicaMismatch, StragglerDetector
from trainspec.core.backend import Engine
from trainspec.core.loop import Checkpointer, Preempted, StopSignals, progress_bar
from trainspec.core.profile import TraceWindow
from trainspec.core.recorder import Recorder
from trainspec.core.run_files import AlreadyTrained, resume_line, resume_mark, save_spec
from trainspec.core.run_rollback import Job, Rollbacks
from trainspec.core.sinks import sinks_for

log = logging.getLogger("trainspec")

# (excluded device ids) -> the job on the devices left: how a run rolls back after replicas
# diverged (trainspec.jax.train builds the reference job again on them).
Rebuild = Callable[[list[int]], Job]


class Run(Rollbacks):
    """One invocation's run services over `run_dir`; a context manager around the loop.

    `steps`: train to this step. `restart`: set the checkpoints aside and start from step 0.
    `announce(line)` is told where a resume starts; `faults` is the test hook (nothing is
    injected unless a test passes one); `rebuild` makes a rollback onto fewer devices possible.
    """

    def __init__(self, spec, run_dir: Path, checkpointer: Checkpointer, steps: int, *,
                 restart: bool = False, progress: bool = True, announce=None,
                 faults: Faults | None = None, spec_label: str = "default",
                 rebuild: Rebuild | None = None):
        self.spec, self.run_dir, self.ckpt, self.steps = spec, Path(run_dir), checkpointer, steps
        self.progress, self.announce, self.faults = progress, announce, faults or Faults()
        self.spec_label, self.rebuild = spec_label, rebuild
        self.restart = restart
        self.goodput = Goodput()  # from here: initialisation and restore count as badput
        self.pipeline: dict | None = None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = steps
        self._init_rollbacks(spec)
        self.summary_fields: dict = {}  # the caller's own (preflight, say)
        self.step: Engine | None = None
        self.start: int | None = None  # where this invocation resumed
        self.at = 0  # steps done: the data position
        self.recorder = self.bar = None
        self.signals = StopSignals()
        self._times: list[tuple[int, float]] = []
        self.eval_loss: float | None = None  # the newest evaluation's ([eval])

    def __enter__(self) -> Run:
        """Opens the checkpoints: sets them aside under `restart`; `total_steps` becomes the
        run length the newest one was planned for (a resume keeps its learning-rate schedule)."""
        self.ckpt.__enter__()
        try:
            if self.restart:
                for moved in self.ckpt.set_aside():
                    log.warning("--restart: checkpoint moved to %s", moved)
            self.total_steps = self.ckpt.saved_total_steps() or self.steps
            if self.total_steps < self.steps:  # the cosine ends at a tenth of its peak
                log.warning(f"--steps {self.steps}: the checkpoints were planned for "
                            f"{self.total_steps} steps; the spec's learning-rate schedule stays "
                            f"theirs and holds its floor after step {self.total_steps} "
                            f"(--restart plans it over {self.steps})")
        except BaseException:
            self.ckpt.__exit__(*sys.exc_info())
            raise
        return self

    # -- resume ----------------------------------------------------------------------------
    def resume(self, init_fn: Callable | None = None, *args):
        """The state to train from, the same call on every backend: the newest good checkpoint,
        restored straight into the step's planned layout, or, only when there is none, the
        state `init_fn(*args)` starts from. What `init_fn` is, is the backend's Run's to say
        (trainspec.jax.Run: it builds the state, as `step.init` takes it; trainspec.torch.Run:
        optional, it initialises the step's model in place); the loop of `trainspec train`
        restores its own job with `restore`."""
        return self.restore(*self._resume_job(init_fn, *args))

    def _resume_job(self, init_fn: Callable | None, *args) -> tuple[Engine, Any, Callable[[], Any]]:
        """(the engine, the target a checkpoint is placed like, what builds the state when there
        is none) for `resume(init_fn, *args)`: a backend's Run knows its step."""
        raise TypeError("trainspec.core.run.Run holds no step: resume a trainspec.jax.Run or "
                        "trainspec.torch.Run, or restore(step, target, init) a job")

    def restore(self, step: Engine, target, init: Callable[[], Any]):
        """The state to train `step` from: the newest good checkpoint placed like `target`
        (restored straight into the step's planned layout), or, only when there is none,
        `init()`."""
        t0 = time.perf_counter()
        state, meta = self.ckpt.restore_latest(target)
        if meta is None:
            state = init()
        self.goodput.add("checkpoint_restore" if meta else "initialization",
                         time.perf_counter() - t0)
        self.at = meta["data_position"] if meta else 0
        if self.start is None:
            self.start = self.at
            if self.start >= self.steps:  # before anything is compiled or written
                raise AlreadyTrained(self.run_dir, self.start, self.steps)
            self.stragglers = StragglerDetector(self.spec.health.stragglers, step.participants)
            self.evaluates = evaluation.evaluates(self.spec, step, step.is_writer)
            if step.is_writer:
                save_spec(self.spec, self.run_dir)
        self.resume_mark = resume_mark(meta) if meta else None  # on the first record after it
        counts = (meta or {}).get("health", {})  # the non-finite counts carry on across a resume
        self.skipped_batches |= set(counts.get("skipped_batches", ()))
        self.spikes.forget_after(self.at)
        self._pending.clear()
        self._job = (target, init)  # what a rollback after a bad step restores onto
        self.skipped = counts.get("skipped_steps", 0)
        step.reset_guard(self.at, self.skipped, counts.get("consecutive_nonfinite", 0))
        self.step, self.state = step, state
        self.pipeline = run_record(self.spec, step.mesh_shape)  # its bubble is badput
        self.goodput.bubble = self.pipeline["idle_fraction"] if self.pipeline else 0.0
        if self.resume_mark and self.announce and step.is_writer:
            self.announce(resume_line(self.resume_mark, step.mesh_shape))
        return state

    # -- the loop ----------------------------------------------------------------------------
    def batches(self, data: Callable[[int], dict]):
        """Each step's batch, from the resume point to `steps`: `data(i)` is batch `i` (0-based,
        a pure function of it, this process's rows). The step is measured on the first batch
        (which the first step then uses) before the first step's clock starts."""
        self._data = data
        self._prefetched = self._batch(self.at)
        self._open_records(self._prefetched)
        self.bar = progress_bar(self.steps, self.progress and self.step.is_writer)
        self.bar.update(self.at)
        self.signals.install = self.step.local_signals
        marks = StepMarks(self.run_dir, self.step.process_index, len(self.step.participants))
        self.traces = TraceWindow(self.spec, self.run_dir, self.step)
        with self.signals:
            self.recorder.start()
            while self.at < self.steps:
                self.at += 1
                self._step_began = time.perf_counter()
                self.faults.delay(self.at, self.step.process_index)
                t0 = time.perf_counter()
                batch, self._prefetched = self._prefetched, None
                batch = self._batch(self.at - 1) if batch is None else batch
                self._data_wait = time.perf_counter() - t0
                marks.entered(self.at)  # whoever waits for this process names its step
                self.traces.before_step(self.at, self.step)
                yield batch
        self.bar.close()
        self.traces.after_step(None, self.step, self.state)
        self.step.finish(self.state)
        self._timed_checkpoint_io(self.ckpt.wait)  # complete before the summary says so

    def _batch(self, position: int) -> dict:
        """The batch of the step at `position` (0-based): the next data index not skipped
        (faults are planted by data index: a skipped batch is never read again)."""
        index = bad_steps.batch_index(position, self.skipped_batches)
        return self.faults.batch(index + 1, self._data(index))

    def _open_records(self, batch) -> None:
        facts = self.step.facts(self.state, batch)
        if self.recorder is None:
            sinks = sinks_for(self.spec, self.run_dir, self.step.is_writer,
                              append=self.at > 0)
            self.recorder = Recorder(self.spec, facts, sinks, self.steps, self.goodput,
                                     self.at + 1, reader=self.step,
                                     per_record=self.step.per_record)
            self._writes = self.step.is_writer
        else:  # after a rollback: records after the restored step are redone
            if self.step.is_writer != self._writes:  # the writer was left out (torch): this
                self.recorder.close()                 # process writes the records now
                self.recorder.sinks = sinks_for(self.spec, self.run_dir, self.step.is_writer,
                                                append=True)
                self._writes = self.step.is_writer
            self.recorder.reader = self.step
            self.recorder.per_record = self.step.per_record
            self.recorder.restart(facts, self.at + 1)

    def after_step(self, state, metrics: dict):
        """After the step the last batch was for: record when due, check replicas, stop on a
        signal, checkpoint when due. Returns the state to go on with (a rollback's)."""
        self._times.append((self.at, time.perf_counter() - self._step_began))
        self.faults.crash(self.at)
        target = self.faults.bitflip_target(self.at)
        self.state = state if target is None else self.step.corrupt(state, target)
        signum = self.step.stop_signal(self.at, self.signals.received)
        checkpointing = self.ckpt.enabled and (
            signum is not None or self.ckpt.due(self.at, self.steps))
        if self._rolled_back_after_bad_step(metrics, checkpointing or self.at == self.steps):
            return self.state
        self._record(metrics, checkpointing)
        self.traces.after_step(self.at, self.step, self.state)
        if self._rolled_back_after_divergence(checkpointing=signum is not None):
            return self.state
        if signum is not None:
            raise self._preempted(signum)
        self._checkpoint()
        return self.state

    def _record(self, metrics: dict, checkpointing: bool) -> None:
        """Host sync only when a record is due (metrics.interval, first and last step, a
        checkpoint after this step, an evaluation)."""
        evaluating = self.evaluates and evaluation.due(self.spec, self.at)
        evaluated = self._evaluate() if evaluating else {}
        record = self.recorder.after_step(
            self.at, metrics, self._data_wait, due=checkpointing or evaluating,
            extra=lambda host: {**self._record_fields(host, checkpointing), **evaluated})
        if record is None:
            return
        self.bar.update(self.at - self.bar.n)
        self.bar.set_postfix(loss=f"{self.recorder.losses[self.at]:.3f}",
                             tok_s=f"{record['tokens_per_s']:.0f}",
                             mfu=f"{100 * (record['mfu'] or 0):.1f}%")

    def _evaluate(self) -> dict:
        """`eval_loss` on the step's eval batches (trainspec.core.evaluation); its time is
        neither step time nor productive (goodput's `evaluation`)."""
        t0 = time.perf_counter()
        sums = [self.step.evaluate(self.state, self.step.eval_data(i))
                for i in range(self.spec.eval.batches)]
        seconds = time.perf_counter() - t0
        self.recorder.exclude(seconds)
        self.goodput.add("evaluation", seconds)
        self.eval_loss = evaluation.eval_loss(sums)
        return {"eval_loss": self.eval_loss}

    def _record_fields(self, host_metrics: dict, checkpointing: bool) -> dict:
        """The fields the run adds to a record: health, the step's learning rate, and the
        marks of a resume just before it and of a checkpoint just after it."""
        self.skipped = self.step.check_nonfinite()  # raises HealthHalt when tripped
        self._observe_stragglers()
        # The optimizer's update count at this step: the steps before it less those skipped.
        skipped_before = self.skipped - int(host_metrics.get("nonfinite", 0))
        fields = {"skipped_steps": self.skipped, "stragglers": self.stragglers.stragglers(),
                  "learning_rate": self.step.learning_rate(self.at - 1 - skipped_before),
                  "framework": self.step.framework}
        if self.resume_mark is not None:
            fields.update(self.resume_mark)
            self.resume_mark = None
        if self.rolls_back:
            fields["skipped_batches"] = len(self.skipped_batches)
        if self.rollback_mark is not None:
            fields.update(self.rollback_mark)
            self.rollback_mark = None
        if checkpointing:
            fields["checkpoint_saved"] = True
        return fields

    def _observe_stragglers(self) -> None:
        """Every process's step times since the last record (one gather per record)."""
        if not self._times:
            return
        every = self.step.gather_times(np.array([t for _, t in self._times]))
        for i, (step, _) in enumerate(self._times):
            self.stragglers.observe(step, every[:, i])
        self._times.clear()

    # -- checkpoints, stops ------------------------------------------------------------------
    def _timed_checkpoint_io(self, io, *args) -> None:
        """Run a checkpoint call; the time the loop is held up by it is checkpoint badput."""
        t0 = time.perf_counter()
        io(*args)
        self.goodput.add("checkpoint_save", time.perf_counter() - t0)

    def _checkpoint(self, force: bool = False) -> None:
        """Checkpoint the current step when due (or `force`d by a stop signal)."""
        if force or self.ckpt.due(self.at, self.steps):
            self.skipped = self.step.check_nonfinite()  # never checkpoint a frozen state
            self._timed_checkpoint_io(self.ckpt.save, self.at, self.state, self.total_steps,
                                      self._health_counts())

    def _health_counts(self) -> dict:
        """What a checkpoint carries on for the guards: the non-finite counts, the skipped
        batches (a resume from it leaves them out too)."""
        return {**self.step.nonfinite_counts(), "skipped_batches": sorted(self.skipped_batches)}

    def _halted(self, halt: HealthHalt) -> HealthHalt:
        """Checkpoint the state the guard froze (the last good one) and say where it is, or
        that nothing kept it."""
        if not self.ckpt.enabled:
            return HealthHalt(f"{halt}; no checkpoint kept a state (checkpoint.interval = 0)",
                              halt.last_good_step)
        self.ckpt.save(halt.last_good_step, self.state, self.total_steps,
                       self._health_counts())
        self.ckpt.wait()
        return HealthHalt(f"{halt}; the state after step {halt.last_good_step} is checkpoint "
                          f"{halt.last_good_step} in {self.ckpt.directory}", halt.last_good_step)

    def _preempted(self, signum: int) -> Preempted:
        """After a stop signal: checkpoint this step on every process and wait for it."""
        name = signal.Signals(signum).name
        if not self.ckpt.enabled:
            return Preempted(f"{name} after step {self.at}; no checkpoint written "
                             "(checkpoint.interval = 0)", signum)
        self._checkpoint(force=True)
        self._timed_checkpoint_io(self.ckpt.wait)
        return Preempted(f"{name} after step {self.at}; checkpoint {self.at} is in "
                         f"{self.ckpt.directory}", signum)

    def __exit__(self, exc_type, exc, tb) -> None:
        self.signals.__exit__()
        if self.bar is not None:
            self.bar.close()
        if self.recorder is not None:
            self.recorder.close()
        if isinstance(exc, HealthHalt) and self.step is not None:
            # the last good save completes before the halt; the state in memory is not good
            if isinstance(exc, (ReplicaMismatch, bad_steps.RollbackLimit)):
                self.ckpt.wait()
            else:
                halted = self._halted(exc)
                self.ckpt.__exit__(None, None, None)
                raise halted from None
        self.ckpt.__exit__(exc_type, exc, tb)

    # -- the summary ---------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        spec = self.step.spec
        return {
            **self.recorder.summary(),  # losses, tokens_per_s, step_time_s, mfu, memory, ...
            "steps": self.steps,
            "eval_loss": self.eval_loss,
            "resumed_from": self.start,
            "last_checkpoint": self.ckpt.last_saved,
            "rollbacks": self.rollbacks,
            "excluded_devices": list(spec.mesh.exclude_devices),
            "skipped_steps": self.skipped,
            "skipped_batches": sorted(self.skipped_batches),
            **self.stragglers.report(),
            "mesh": self.step.mesh_shape,
            "accumulation_steps": spec.batch.accumulation_steps,
            "pipeline": self.pipeline,  # the executed schedule's slots; None without one
            "gns_not_measured": self.step.gns_note,  # None when measured
            **self.step.summary_fields(),
            **self.summary_fields,
            "spec": self.spec_label,
            "metrics_file": str(self.run_dir / spec.metrics.path),
            "framework": self.step.framework,
        }
