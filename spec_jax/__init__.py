"""trainspec's reference implementation on JAX/XLA.

The public entry points: `load_spec`, `build_mesh`, `wrap`, `loss_step`.
"""
from spec_jax.errors import UserInputError
from spec_jax.mesh import build_mesh
from spec_jax.spec import Spec, default_spec, load_spec
from spec_jax.step import WrappedStep, loss_step, wrap

__all__ = [
    "Spec", "UserInputError", "WrappedStep", "build_mesh", "default_spec", "load_spec",
    "loss_step", "wrap",
]
