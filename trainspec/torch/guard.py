"""The non-finite policy of `[health.nan]` on torch: the core's state machine
(trainspec.core.health.nan_guard_step) run on tensors of the step's device, so that a step's
decision to take its update or drop it never waits for the host. The counts are read on the
host only when asked (a record, a checkpoint)."""
from __future__ import annotations

import torch

from trainspec.core.health import (
    check_nan_guard, init_nan_guard, nan_guard_counts, nan_guard_step)
from trainspec.core.spec_health import NanSpec


class DeviceGuard:
    """The guard record of `policy` as int32 tensors on `device`; calling it with a step's
    `finite` (a bool tensor) advances it and returns `take` (a bool tensor)."""

    def __init__(self, policy: NanSpec, device: torch.device, step: int = 0, skipped: int = 0,
                 consecutive: int = 0):
        self.policy, self.device = policy, device
        self.state = {k: torch.as_tensor(v, device=device)
                      for k, v in init_nan_guard(step, skipped, consecutive).items()}
        self._always = torch.ones((), dtype=torch.bool, device=device)

    def __call__(self, finite: torch.Tensor) -> torch.Tensor:
        self.state, take = nan_guard_step(self.policy, self.state, finite, torch.where)
        if take is True:  # rollback keeps every update: one tensor, not one per step
            return self._always
        return take

    def check(self) -> int:
        """At a host sync: HealthHalt if the guard tripped; else the steps it skipped."""
        return check_nan_guard(self.policy, self.state)

    def counts(self) -> dict[str, int]:
        """The counts a checkpoint carries (read on the host)."""
        return nan_guard_counts(self.state)
