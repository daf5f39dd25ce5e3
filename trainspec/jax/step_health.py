"""The non-finite guard and the host's reads of a wrapped step (trainspec.jax.step.WrappedStep):
where the guard's record and the metrics live, how a step's metrics, the guard and the
rollback verdicts are read back, and the state's finiteness check before a checkpoint
(docs/wrapping.md, health.nan).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from trainspec.core.semi_sync import combine_groups
from trainspec.jax.health import nan as nan_guard

# The metrics a rollback verdict reads (SemiSyncStep weighs the groups' losses by tokens).
VERDICT_METRICS = ("loss", "grad_norm", "loss_tokens", "valid_tokens")


class StepHealth:
    """The guard and host reads of WrappedStep, which sets `spec`, `mesh`, `groups`,
    `nan_guard`, `rolls_back`, `state_pspecs`, `guard` and `data_axes`."""

    def _guarded(self, guard, state, new_state, metrics):
        if self.groups is not None:
            return self.groups.guarded(self, guard, state, new_state, metrics)
        return nan_guard.guarded(self.spec.health.nan, guard, state, new_state, metrics,
                                 self.mesh, self.state_pspecs)

    @property
    def guard_sharding(self) -> NamedSharding:
        """Where the non-finite guard's record and the step's metrics live: replicated
        (with `groups`: one per group, split over the data axes)."""
        return NamedSharding(self.mesh, P(self.data_axes) if self.groups is not None else P())

    metrics_sharding = guard_sharding

    def to_host(self, tree):
        """Device arrays of this step (metrics, the guard) as NumPy on the host."""
        if self.groups is not None:
            return self.groups.to_host(tree)
        return jax.device_get(tree)

    def combine_metrics(self, metrics: dict) -> dict:
        """The record's values from the step's metrics on the host (with `groups`: combined
        from the groups' values)."""
        return combine_groups(metrics)

    def host_metrics(self, metrics: dict) -> dict:
        """A step's metrics as the record reads them: on the host, `loss`, `grad_norm`,
        `valid_tokens`, ... of the whole step (a host sync)."""
        return self.combine_metrics(self.to_host(metrics))

    def reset_guard(self, step: int = 0, skipped: int = 0, consecutive: int = 0) -> None:
        """Start the non-finite guard `step` steps into the run, with the counts of skipped
        and consecutive non-finite steps a restored checkpoint carries."""
        per_group = self.replicas if self.groups is not None else None  # else one guard
        record = (nan_guard.init_guard(step, skipped, consecutive, per_group)
                  if self.nan_guard and not self.rolls_back else {})
        self.guard = jax.device_put(record, self.guard_sharding)

    def check_nonfinite(self) -> int:
        """At a host sync: raise HealthHalt if the nan_guard tripped; else the steps it skipped,
        counted on from `reset_guard`'s (0 without the guard). Reads the small guard record only."""
        if not self.nan_guard or self.rolls_back or self.guard is None:
            return 0
        return nan_guard.check(self.spec.health.nan, self.to_host(self.guard))

    def nonfinite_counts(self) -> dict[str, int]:
        """The guard's skipped and consecutive non-finite steps as of the last step whose
        update was kept: what a checkpoint of the state carries on (zeros without the guard)."""
        if not self.nan_guard or self.rolls_back or self.guard is None:
            return {"skipped_steps": 0, "consecutive_nonfinite": 0}
        return nan_guard.counts(self.to_host(self.guard))

    def verdict_inputs(self, metrics: dict):
        """Under `rollback`: the metrics that judge this step, still on device (read later by
        `read_verdicts`); None otherwise."""
        if not self.rolls_back:
            return None
        return {k: v for k, v in metrics.items() if k in VERDICT_METRICS}

    def read_verdicts(self, inputs: list) -> list[tuple[bool, float | None]]:
        """(the gradient norm is finite, the loss) of each step's `verdict_inputs`: one host
        read of them all, whose transfers overlap. On 8 simulated devices (AMD EPYC VM, 2
        cores) ten steps' scalars took 0.95 ms read one step at a time against 0.64 ms at once
        on a quiet machine, and 1.5-5.5 ms against 0.8-0.9 ms while the test suite ran."""
        verdicts = []
        for metrics in self.to_host(inputs):
            host = self.combine_metrics(metrics)
            finite = bool(np.all(np.isfinite(host.get("grad_norm", 0.0))))
            verdicts.append((finite, float(host["loss"]) if "loss" in host else None))
        return verdicts

    def state_is_finite(self, state) -> bool:
        """Every floating element of `state` finite: each device checks its slices, one
        all-reduce of one integer, compiled once (run before checkpoints, not per step)."""
        if self._state_check is None:
            def check(state):
                return nan_guard.state_is_finite(state, self.mesh, self.state_pspecs)
            self._state_check = jax.jit(check, out_shardings=NamedSharding(self.mesh, P()))
        with self.context():
            return bool(self._state_check(state))
