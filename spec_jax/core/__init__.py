"""The spec itself, framework-free: formulas and decisions that import neither jax nor torch."""
