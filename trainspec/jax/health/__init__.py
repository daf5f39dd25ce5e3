"""Run health guards on JAX: non-finite steps, replica fingerprints, device exclusion.

The decisions (NaN policy, fingerprint vote, straggler rule) and the exceptions a guard raises
(`HealthHalt`, `ReplicaMismatch`) are trainspec.core.health's. Each guard is proved by injecting
its fault (tests/jax/test_health_*.py, notebooks/04_reliability).
"""
