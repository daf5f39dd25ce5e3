"""What a guard raises on the host when the run must stop (or roll back)."""
from __future__ import annotations


class HealthHalt(RuntimeError):
    """A guard stopped the run. `last_good_step` is the step whose state is known good."""

    def __init__(self, message: str, last_good_step: int):
        super().__init__(message)
        self.last_good_step = last_good_step


class ReplicaMismatch(HealthHalt):
    """Replicas that should hold identical bytes do not; `devices` are the diverged ones."""

    def __init__(self, message: str, last_good_step: int, devices: list[int]):
        super().__init__(message, last_good_step)
        self.devices = devices
