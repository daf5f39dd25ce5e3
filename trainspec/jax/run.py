"""A wrapped JAX step in the run loop (trainspec.core.loop): `JaxStep`, the core's `Step`
protocol over a WrappedStep, and `Run`, the run services for a user's own loop:

    step = trainspec.jax.wrap(loss_step(loss_fn), spec)
    with trainspec.jax.Run(spec, "runs/mine", step, steps=100) as run:
        state = run.resume(init_fn, rng)          # newest good checkpoint, else step.init(...)
        for batch in run.batches(batch_at):       # batch_at(i): batch i, a pure function of i
            state, metrics = step(state, batch)
            state = run.after_step(state, metrics)
    print(run.summary())

The records, checkpoints (orbax, trainspec.jax.checkpoint), progress bar and summary are those
of `trainspec train` (docs/wrapping.md, "Run services for your own loop").
"""
from __future__ import annotations

import signal
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from trainspec.core import run as core_run
from trainspec.core.flops import ModelFlops
from trainspec.core.health import ReplicaMismatch
from trainspec.core.run_files import refuse_foreign_checkpoints
from trainspec.jax.checkpoint import Checkpointer
from trainspec.jax.evaluate import eval_sums
from trainspec.jax.health.faults import flip_first_param
from trainspec.jax.health.memory import check_step
from trainspec.jax.health.replicas import ReplicaFingerprints
from trainspec.jax.metrics.logger import analyze_step, live_memory
from trainspec.jax.semi_sync import SemiSyncStep
from trainspec.jax.step import WrappedStep


class JaxStep:
    """trainspec.core.loop.Step over `wrapped`. `model_flops`: the model's analytic FLOPs
    (without it MFU is null and XLA's count is the hardware FLOPs); `schedule(updates)`: the
    learning rate the records carry (null without it)."""

    framework = "jax"

    def __init__(self, wrapped: WrappedStep, model_flops: ModelFlops | None = None,
                 schedule=None, eval_data=None):
        self.wrapped, self.model_flops, self.schedule = wrapped, model_flops, schedule
        self.eval_data = eval_data  # eval batch i (this process's rows): [eval]
        self.spec, self.gns_note = wrapped.spec, wrapped.gns_note
        self.mesh_shape = wrapped.dims.shape
        self.replicas = ReplicaFingerprints(wrapped.mesh, wrapped.dims.axes_with_role("data"))
        self.process_index, processes = jax.process_index(), jax.process_count()
        self.is_writer = self.process_index == 0
        self.participants = [f"process {i}" for i in range(processes)]
        # Across processes SIGTERM belongs to jax's preemption notifier, which agrees on the
        # step to stop at through the coordination service (trainspec.core.launch sends it).
        self.local_signals = processes == 1

    def __call__(self, state, batch):
        return self.wrapped(state, batch)

    def evaluate(self, state, batch) -> tuple[float, float]:
        return eval_sums(self.wrapped, state, batch)

    # -- [profile] ------------------------------------------------------------------------
    @staticmethod
    def start_trace(directory: Path) -> None:
        """jax.profiler's trace: TensorBoard's profile plugin reads DIR/plugins/profile/*/
        (*.xplane.pb); Perfetto opens its *.trace.json.gz."""
        jax.profiler.start_trace(str(directory), create_perfetto_trace=True)

    @staticmethod
    def stop_trace() -> None:
        jax.profiler.stop_trace()

    # -- records ---------------------------------------------------------------------------
    def facts(self, state, batch) -> dict:
        """Compiles the step once and measures it (FLOPs, memory, comm); refuses a step that
        cannot fit before the first step takes the memory."""
        fields = analyze_step(self.wrapped, state, batch, self.model_flops).fields
        check_step(fields)
        return fields

    per_record = staticmethod(live_memory)

    def to_host(self, tree):
        return self.wrapped.to_host(tree)

    def combine_metrics(self, metrics: dict) -> dict:
        return self.wrapped.combine_metrics(metrics)

    def learning_rate(self, updates: int) -> float | None:
        return None if self.schedule is None else float(self.schedule(updates))

    def summary_fields(self) -> dict:
        # schedule and bytes of the inner and outer programs (comm_bytes_per_step amortises)
        semi = self.wrapped.summary() if isinstance(self.wrapped, SemiSyncStep) else None
        return {"semi_sync": semi}

    # -- health ----------------------------------------------------------------------------
    def reset_guard(self, step: int, skipped: int, consecutive: int) -> None:
        self.wrapped.reset_guard(step, skipped, consecutive)

    def check_nonfinite(self) -> int:
        return self.wrapped.check_nonfinite()

    def nonfinite_counts(self) -> dict[str, int]:
        return self.wrapped.nonfinite_counts()

    def verdict_inputs(self, metrics):
        return self.wrapped.verdict_inputs(metrics)

    def read_verdicts(self, inputs: list) -> list[tuple[bool, float | None]]:
        return self.wrapped.read_verdicts(inputs)

    def state_is_finite(self, state) -> bool:
        return self.wrapped.state_is_finite(state)

    def check_replicas(self, state, step: int, last_good_step: int | None) -> None:
        found = self.replicas.check(state)
        if found:
            devices = sorted({d for f in found for d in f.devices})
            more = f" (+{len(found) - 1} more arrays)" if len(found) > 1 else ""
            raise ReplicaMismatch(f"replica fingerprints differ after step {step}: "
                                  f"{found[0].describe()}{more}", last_good_step or 0, devices)

    @staticmethod
    def corrupt(state, target: int):
        return flip_first_param(state, target)

    @staticmethod
    def finish(state) -> None:
        jax.block_until_ready(state)

    # -- processes ---------------------------------------------------------------------------
    def gather_times(self, local: np.ndarray) -> np.ndarray:
        """This process's own times for its steps (data + dispatch, not the wait on its peers)."""
        if len(self.participants) == 1:
            return local[None]
        return np.asarray(multihost_utils.process_allgather(local))

    def stop_signal(self, step: int, received: int | None) -> int | None:
        if self.local_signals:
            return received
        return signal.SIGTERM if multihost_utils.reached_preemption_sync_point(step) else None


def abstract_state(wrapped: WrappedStep, init_fn, *args):
    """Shapes, dtypes and planned shardings of `init_fn(*args)`'s state: nothing computed."""
    from trainspec.jax.layout import strip_boxes

    boxed = wrapped.plan(init_fn, *args)
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=sharding), strip_boxes(boxed), wrapped.state_shardings)


class Run(core_run.Run):
    """The run services (trainspec.core.run.Run) for a user's own loop around `step`, a
    WrappedStep: orbax checkpoints in `run_dir`, the spec's metrics sinks, progress, summary.
    `steps` defaults to `train.steps`; `schedule(updates)` and `model_flops` fill the records'
    learning rate and MFU; `eval_data(i)`, eval batch i (this process's rows) under `[eval]`.
    Other options as trainspec.core.run.Run."""

    def __init__(self, spec, run_dir, step: WrappedStep, steps: int | None = None, *,
                 schedule=None, model_flops: ModelFlops | None = None, eval_data=None,
                 **options):
        run_dir = Path(run_dir)
        if not options.get("restart"):  # before orbax lists them (and warns they are not its own)
            refuse_foreign_checkpoints(run_dir / spec.checkpoint.dir, "jax")
        super().__init__(spec, run_dir, Checkpointer(spec, run_dir), steps or spec.train.steps,
                         **options)
        self.jax_step = JaxStep(step, model_flops, schedule, eval_data)

    def resume(self, init_fn, *args):
        """The state to train from: the newest good checkpoint, restored straight into the
        step's planned shardings, or, only when there is none, `step.init(init_fn, *args)`."""
        wrapped = self.jax_step.wrapped
        return self._restore(self.jax_step, abstract_state(wrapped, init_fn, *args),
                             lambda: wrapped.init(init_fn, *args))
