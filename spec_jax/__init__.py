"""trainspec: the spec (spec_jax.core, framework-free) and its reference implementation on JAX/XLA.

The public entry points: `load_spec`, `build_mesh`, `wrap`, `loss_step`, `grad_step`.

The JAX entry points are imported on first use, so that `import spec_jax.core` (which imports
this package first) loads neither jax nor any other framework.
"""
import importlib

from spec_jax.core.errors import UserInputError
from spec_jax.core.spec import Spec, default_spec, load_spec

_JAX_ENTRY_POINTS = {
    "build_mesh": "spec_jax.mesh",
    "WrappedStep": "spec_jax.step",
    "loss_step": "spec_jax.step_forms",
    "grad_step": "spec_jax.step_forms",
    "wrap": "spec_jax.semi_sync",  # a WrappedStep, or a SemiSyncStep under `[semi_sync]`
}

__all__ = ["Spec", "UserInputError", "default_spec", "load_spec", *_JAX_ENTRY_POINTS]


def __getattr__(name: str):
    if name not in _JAX_ENTRY_POINTS:
        raise AttributeError(f"module 'spec_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_JAX_ENTRY_POINTS[name]), name)


def __dir__():
    return sorted(__all__)
