"""The training loop's health guards in one object, so the train session reads top to bottom.

Per step: time it (stragglers). At each sync the loop already makes (metrics interval): read
the non-finite guard, gather step timings. Every `health.fingerprints.interval` steps and
before every checkpoint: compare replica fingerprints.
"""
from __future__ import annotations

import contextlib
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from trainspec.core.health import ReplicaMismatch, StragglerDetector
from trainspec.core.spec import Spec
from trainspec.jax.health.replicas import ReplicaFingerprints


class Guards:
    def __init__(self, spec: Spec, job, skipped_before: int = 0):
        """`skipped_before`: non-finite steps skipped before the checkpoint this run resumed
        (the guard on device counts on from there)."""
        self.spec = spec
        participants = [f"process {i}" for i in range(jax.process_count())]
        self.stragglers = StragglerDetector(spec.health.stragglers, participants)
        self.skipped = skipped_before
        self._times: list[tuple[int, float]] = []
        self.job = job
        self.replicas = ReplicaFingerprints(job.step.mesh, job.spec.mesh.axes_with_role("data"))

    # -- per step -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def timed(self, step: int):
        """This process's own time for the step: data + dispatch, not the wait on its peers."""
        t0 = time.perf_counter()
        yield
        self._times.append((step, time.perf_counter() - t0))

    # -- at syncs -----------------------------------------------------------------------------
    def at_sync(self) -> dict:
        """Raise HealthHalt if the non-finite guard tripped; feed timings; fields for metrics."""
        self.check_nonfinite()
        if self._times:
            steps = [s for s, _ in self._times]
            local = np.array([t for _, t in self._times])
            every = multihost_utils.process_allgather(local) if jax.process_count() > 1 else local[None]
            for i, step in enumerate(steps):
                self.stragglers.observe(step, every[:, i])
            self._times.clear()
        report = self.stragglers.report()
        return {"skipped_steps": self.skipped, "stragglers": report["stragglers"]}

    def check_nonfinite(self) -> None:
        self.skipped = self.job.step.check_nonfinite()

    def counts(self) -> dict[str, int]:
        """The non-finite guard's counts, to checkpoint with the state (a host sync)."""
        return self.job.step.nonfinite_counts()

    def fingerprint_due(self, step: int) -> bool:
        n = self.spec.health.fingerprints.interval
        return n > 0 and step % n == 0

    def check_replicas(self, step: int, state, last_good_step: int | None) -> None:
        """Raise ReplicaMismatch naming the diverged replicas and devices."""
        found = self.replicas.check(state)
        if found:
            devices = sorted({d for f in found for d in f.devices})
            first = found[0].describe()
            more = f" (+{len(found) - 1} more arrays)" if len(found) > 1 else ""
            raise ReplicaMismatch(
                f"replica fingerprints differ after step {step}: {first}{more}", last_good_step or 0, devices
            )

    def summary(self) -> dict:
        return {"skipped_steps": self.skipped, **self.stragglers.report()}
