"""The default training job: the reference transformer on the embedded corpus, under a spec.

`build_job` assembles model, optimizer, data and the wrapped step; `run` is the loop that
`trainspec train` calls. The loop syncs with the device only at the metrics interval.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from trainspec.jax.checkpoint import Checkpointer
from trainspec.core.data import ByteBatches
from trainspec.jax.distributed import is_writer
from trainspec.jax.feed import Feed
from trainspec.core.health import HealthHalt, ReplicaMismatch
from trainspec.jax.health.exclusion import exclude, largest_mesh
from trainspec.jax.health.faults import Faults
from trainspec.jax.health.guards import Guards
from trainspec.jax.health.memory import check_step
from trainspec.jax.health.preflight import preflight
from trainspec.jax.layout import strip_boxes
from trainspec.jax.metrics import MetricsLogger
from trainspec.core.goodput import Goodput
from trainspec.core.transformer_flops import for_spec as model_flops
from trainspec.jax.models.transformer import Transformer, next_token_loss
from trainspec.core.run_files import (
    AlreadyTrained, refuse_foreign_checkpoints, resume_line, resume_mark, save_spec,
    write_json_atomically)
from trainspec.core.spec import Spec
from trainspec.jax.preemption import Preempted, StopSignals
from trainspec.jax.semi_sync import SemiSyncStep, wrap
from trainspec.jax.step import WrappedStep
from trainspec.jax.step_forms import loss_step


log = logging.getLogger(__name__)


def make_schedule(spec: Spec, total_steps: int) -> optax.Schedule:
    """Learning rate by update count: linear warm-up from 0, cosine decay to a tenth."""
    o = spec.optimizer
    return optax.warmup_cosine_decay_schedule(
        0.0, o.learning_rate, min(o.warmup_steps, total_steps - 1), max(total_steps, 2),
        end_value=o.learning_rate * 0.1,
    )


def make_optimizer(spec: Spec, total_steps: int) -> optax.GradientTransformation:
    o = spec.optimizer
    schedule = make_schedule(spec, total_steps)
    opt = (
        optax.adamw(schedule, weight_decay=o.weight_decay)
        if o.name == "adamw"
        else optax.sgd(schedule, momentum=0.9)
    )
    return optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), opt) if o.grad_clip_norm else opt


@dataclasses.dataclass
class Job:
    """The wrapped step with its state planned. `state` is built by `init_state()` (or comes
    from a checkpoint restored into `abstract_state`), never both."""

    spec: Spec
    model: Transformer
    step: WrappedStep
    data: ByteBatches
    abstract_state: Any  # shapes, dtypes and target shardings of the state: nothing computed
    init_fn: Any
    state: Any = None

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {name: int(size) for name, size in self.step.mesh.shape.items()}

    def init_state(self):
        """A fresh state, initialised sharded (it is never whole on one device)."""
        self.state = self.step.init(self.init_fn, jax.random.key(self.spec.seed))
        return self.state


def _components(spec: Spec, total_steps: int):
    model = Transformer(
        spec.model,
        dtype=jnp.dtype(spec.precision.compute),
        param_dtype=jnp.dtype(spec.precision.param),
        remat=spec.remat.policy,
    )

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        loss_sum, tokens = next_token_loss(logits, batch["targets"], batch["mask"])
        return loss_sum, tokens, {}

    tx = make_optimizer(spec, total_steps)

    def init_state(rng):
        tokens = jnp.zeros((1, spec.batch.seq_len), jnp.int32)
        params = model.init(rng, tokens)["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return model, loss_fn, init_state


def build_abstract_job(spec: Spec, mesh=None):
    """(wrapped step with its state shardings planned, abstract state): nothing is computed."""
    job = build_job(spec, mesh, init=False)
    return job.step, job.abstract_state


def build_job(spec: Spec, mesh=None, total_steps: int | None = None, init: bool = True) -> Job:
    """The reference job; its state initialised unless `init` is false (a restore fills it)."""
    model, loss_fn, init_state = _components(spec, total_steps or spec.train.steps)
    step = wrap(loss_step(loss_fn), spec, mesh)
    boxed = step.plan(init_state, jax.random.key(spec.seed))
    abstract = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=sharding), strip_boxes(boxed), step.state_shardings)
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    job = Job(spec, model, step, data, abstract, init_state)
    if init:
        job.init_state()
    return job


class _Session:
    """One `trainspec train` invocation: the job, its state, and the guards around the loop.

    Each concern is one method, so that `train` reads top to bottom; a rollback re-enters
    `_resume` on the remaining devices. `faults` is the test hook (health.faults): nothing is
    injected unless a test passes one. `restart` sets the existing checkpoints aside (kept)
    and trains from step 0. `announce` is told, in one line, where a resume starts.
    """

    def __init__(self, spec: Spec, run_dir: Path, ckpt: Checkpointer, steps: int,
                 faults: Faults | None, progress: bool, restart: bool = False, announce=None):
        self.steps, self.faults, self.announce = steps, faults or Faults(), announce
        self.ckpt = ckpt
        if restart:
            for moved in self.ckpt.set_aside():
                log.warning("--restart: checkpoint moved to %s", moved)
        self.total_steps = self.ckpt.saved_total_steps() or steps  # a resume keeps its LR schedule
        self.schedule = make_schedule(spec, self.total_steps)
        self.metrics_file = run_dir / spec.metrics.path
        self.rollbacks: list[dict] = []
        self.goodput = Goodput()  # from here: initialisation and restore count as badput
        fault = faults.faulty_reduction_fault() if faults else None
        spec, self.preflight = preflight(spec, self.goodput, fault)  # health.preflight
        self._resume(spec)
        self.start = self.step
        if self.start >= steps:  # before anything is compiled or written
            raise AlreadyTrained(run_dir, self.start, steps)
        self._announce_resume()
        self.bar = _progress_bar(steps, progress and is_writer())
        self.bar.update(self.step)
        # Compiles the step once and measures it (FLOPs, memory, comm); records per interval.
        # Process 0 writes the job's files; the other processes' loggers have no sinks.
        self.metrics_log = MetricsLogger.for_run(
            spec, self.job.step, self.state, self.feed.first, run_dir, steps, model_flops(spec),
            goodput=self.goodput, resume_after=self.step)
        check_step(self.metrics_log.analysis.fields)  # before the first step takes the memory

    def _resume(self, spec: Spec) -> None:
        """Job on the largest mesh the spec allows, state from the newest good checkpoint
        (restored straight into the planned shardings) or, only when there is none, fresh;
        and the data position to continue from."""
        t0 = time.perf_counter()
        self.job = build_job(spec, largest_mesh(spec), total_steps=self.total_steps, init=False)
        t1 = time.perf_counter()
        self.state, meta = self.ckpt.restore_latest(self.job.abstract_state)
        if meta is None:
            self.state = self.job.init_state()
        self.goodput.add("initialization", t1 - t0)
        self.goodput.add("checkpoint_restore" if meta else "initialization",
                         time.perf_counter() - t1)
        self.step = meta["data_position"] if meta else 0
        self.resume_mark = resume_mark(meta) if meta else None  # on the first record after it
        counts = (meta or {}).get("health", {})  # the non-finite counts carry on across a resume
        self.job.step.reset_guard(self.step, counts.get("skipped_steps", 0),
                                  counts.get("consecutive_nonfinite", 0))
        self.guards = Guards(spec, self.job, counts.get("skipped_steps", 0))
        self.feed = Feed(self.job, self.step)

    def _announce_resume(self) -> None:
        if self.resume_mark and self.announce:
            self.announce(resume_line(self.resume_mark, self.job.mesh_shape))

    def _record(self, metrics, data_wait: float, checkpointing: bool) -> None:
        """Host sync only when a record is due (metrics.interval, first and last step, a
        checkpoint after this step)."""
        record = self.metrics_log.after_step(self.step, metrics, data_wait, due=checkpointing,
                                             extra=lambda host: self._record_fields(host, checkpointing))
        if record is None:
            return
        self.bar.update(self.step - self.bar.n)
        self.bar.set_postfix(loss=f"{self.metrics_log.losses[self.step]:.3f}",
                             tok_s=f"{record['tokens_per_s']:.0f}",
                             mfu=f"{100 * (record['mfu'] or 0):.1f}%")

    def _record_fields(self, host_metrics: dict, checkpointing: bool) -> dict:
        """The fields the loop adds to a record: health, the step's learning rate, and the
        marks of a resume just before it and of a checkpoint just after it. `host_metrics`:
        the step's metrics as the record reads them (already on the host)."""
        fields = self.guards.at_sync()  # counts the skipped steps up to this one
        # The optimizer's update count at this step: the steps before it less those skipped.
        skipped_before = self.guards.skipped - int(host_metrics.get("nonfinite", 0))
        fields["learning_rate"] = float(self.schedule(self.step - 1 - skipped_before))
        if self.resume_mark is not None:
            fields.update(self.resume_mark)
            self.resume_mark = None
        if checkpointing:
            fields["checkpoint_saved"] = True
        return fields

    def _rolled_back_after_divergence(self, checkpointing: bool = False) -> bool:
        """Compare replica fingerprints when due (always before a checkpoint, which must never
        hold a corrupted replica). On a mismatch under `rollback`: exclude the diverged
        devices and resume from the last checkpoint on the rest; returns whether it did."""
        checkpointing = checkpointing or self.ckpt.due(self.step, self.steps)
        if not (self.guards.fingerprint_due(self.step) or checkpointing):
            return False
        try:
            self.guards.check_replicas(self.step, self.state, self.ckpt.last_saved)
            return False
        except ReplicaMismatch as err:
            if self.job.spec.health.fingerprints.policy == "halt":
                raise
            self.rollbacks.append({"step": self.step, "excluded": err.devices, "reason": str(err)})
            self._timed_checkpoint_io(self.ckpt.wait)
            diverged_at = self.step
            self._resume(exclude(self.job.spec, err.devices))
            self._announce_resume()
            self.goodput.lose_steps(diverged_at - self.step)
            self.metrics_log.restart(self.job.spec, self.job.step, self.state, self.feed.first,
                                     self.step + 1, model_flops(self.job.spec))
            return True

    def _timed_checkpoint_io(self, io, *args) -> None:
        """Run a checkpoint call; the time the loop is held up by it is checkpoint badput."""
        t0 = time.perf_counter()
        io(*args)
        self.goodput.add("checkpoint_save", time.perf_counter() - t0)

    def _checkpoint(self, force: bool = False) -> None:
        """Checkpoint the current step when due (or `force`d by a stop signal)."""
        if force or self.ckpt.due(self.step, self.steps):
            self.guards.check_nonfinite()  # never checkpoint a state the NaN guard froze
            self._timed_checkpoint_io(
                self.ckpt.save, self.step, self.state, self.total_steps, self.guards.counts())

    def _halted(self, halt: HealthHalt) -> HealthHalt:
        """Checkpoint the state the guard froze (the last good one) and say where it is, or
        that nothing kept it."""
        if not self.ckpt.enabled:
            return HealthHalt(f"{halt}; no checkpoint kept a state (checkpoint.interval = 0)",
                              halt.last_good_step)
        self.ckpt.save(halt.last_good_step, self.state, self.total_steps, self.guards.counts())
        self.ckpt.wait()
        return HealthHalt(f"{halt}; the state after step {halt.last_good_step} is checkpoint "
                          f"{halt.last_good_step} in {self.ckpt.directory}", halt.last_good_step)

    def _preempted(self, signum: int) -> Preempted:
        """After a stop signal: checkpoint this step on every process and wait for it."""
        name = signal.Signals(signum).name
        if not self.ckpt.enabled:
            return Preempted(f"{name} after step {self.step}; no checkpoint written "
                             "(checkpoint.interval = 0)", signum)
        self._checkpoint(force=True)
        self._timed_checkpoint_io(self.ckpt.wait)
        return Preempted(f"{name} after step {self.step}; checkpoint {self.step} is in "
                         f"{self.ckpt.directory}", signum)

    def train(self) -> None:
        with contextlib.closing(self.metrics_log), StopSignals() as signals:
            self.metrics_log.start()
            try:
                while self.step < self.steps:
                    self.step += 1
                    with self.guards.timed(self.step):
                        self.faults.delay(self.step)
                        host_batch, data_wait = self.feed.batch(self.step - 1)
                        batch = self.faults.batch(self.step, host_batch)
                        self.state, metrics = self.job.step(self.state, batch)
                    self.state = self.faults.state(self.step, self.state)
                    signum = signals.due(self.step)
                    self._record(metrics, data_wait, self.ckpt.enabled and (
                        signum is not None or self.ckpt.due(self.step, self.steps)))
                    if self._rolled_back_after_divergence(checkpointing=signum is not None):
                        continue
                    if signum is not None:
                        raise self._preempted(signum)
                    self._checkpoint()
            except ReplicaMismatch:
                self.ckpt.wait()
                raise
            except HealthHalt as halt:
                raise self._halted(halt) from None
        self.bar.close()
        jax.block_until_ready(self.state)
        # The final checkpoint is complete before the summary says so.
        self._timed_checkpoint_io(self.ckpt.wait)

    def summary(self, spec_label: str) -> dict[str, Any]:
        spec = self.job.spec
        return {
            **self.metrics_log.summary(),  # losses, tokens_per_s, step_time_s, mfu, memory, ...
            "steps": self.steps,
            "resumed_from": self.start,
            "last_checkpoint": self.ckpt.last_saved,
            "rollbacks": self.rollbacks,
            "excluded_devices": list(spec.mesh.exclude_devices),
            "preflight": self.preflight,
            **self.guards.summary(),
            "mesh": self.job.mesh_shape,
            "accumulation_steps": spec.batch.accumulation_steps,
            "gns_not_measured": self.job.step.gns_note,  # None when measured
            # schedule and bytes of the inner and outer programs (comm_bytes_per_step amortises)
            "semi_sync": self.job.step.summary() if isinstance(self.job.step, SemiSyncStep) else None,
            "spec": spec_label,
            "metrics_file": str(self.metrics_file),
        }


def run(
    spec: Spec,
    run_dir: Path,
    steps: int | None = None,
    spec_label: str = "default",
    progress: bool = True,
    summary_json: Path | None = None,
    faults: Faults | None = None,
    restart: bool = False,
    announce=None,
) -> dict[str, Any]:
    """Train to step `steps` (default `train.steps`), resuming from the newest good checkpoint
    in `run_dir` (or from step 0 with `restart`, the old checkpoints set aside); write metrics
    JSONL and checkpoints; return the summary.

    Saves `spec` as RUN_DIR/spec.toml (`trainspec train` reuses it when given no --spec);
    `announce(line)` is told where a resume starts.

    Raises HealthHalt when a guard stops the run, Preempted after SIGTERM/SIGINT (with the
    checkpoint written), UserInputError when the checkpoints are all bad or another framework's
    or a save fails, AlreadyTrained (having changed nothing) when the run is already at or past
    `steps`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not restart:  # before orbax lists them (and warns that they are not its own)
        refuse_foreign_checkpoints(run_dir / spec.checkpoint.dir, "jax")
    with Checkpointer(spec, run_dir) as ckpt:  # closed however the run ends
        session = _Session(spec, run_dir, ckpt, steps or spec.train.steps, faults, progress,
                           restart, announce)
        if is_writer():
            save_spec(spec, run_dir)
        session.train()
        summary = session.summary(spec_label)
    if summary_json is not None and is_writer():
        write_json_atomically(Path(summary_json), summary)
    return summary


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)

