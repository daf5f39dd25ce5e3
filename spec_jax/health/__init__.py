"""Run health guards: non-finite steps, replica fingerprints, stragglers, device exclusion.

Each guard is proved by injecting its fault (tests/test_health_*.py, notebooks/04_reliability).
"""
from spec_jax.health.errors import HealthHalt, ReplicaMismatch

__all__ = ["HealthHalt", "ReplicaMismatch"]
