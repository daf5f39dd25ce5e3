"""The JAX backend's engine (trainspec.core.backend.Engine): a wrapped step (trainspec.jax.step,
trainspec.jax.semi_sync) as the run loop drives it: run it, bring its values to the host, check
them and the state, corrupt a copy for fault tests, compare replica fingerprints. The decisions
around it are the trunk's (trainspec.core.run)."""
from __future__ import annotations

import signal
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from trainspec.core.flops import ModelFlops
from trainspec.core.health import ReplicaMismatch
from trainspec.jax.evaluate import eval_sums
from trainspec.jax.health.faults import flip_first_param
from trainspec.jax.health.memory import check_step
from trainspec.jax.health.replicas import ReplicaFingerprints
from trainspec.jax.metrics.logger import analyze_step, live_memory
from trainspec.jax.semi_sync import SemiSyncStep
from trainspec.jax.step import WrappedStep


class JaxEngine:
    """The engine (trainspec.core.backend.Engine) over a wrapped step. `model_flops`: the model's analytic FLOPs
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
