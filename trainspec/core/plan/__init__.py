"""The planner's framework-free core: hardware profiles, the reference transformer in numbers,
and the memory / communication / step-time model (docs/plan.md). No jax import here."""
