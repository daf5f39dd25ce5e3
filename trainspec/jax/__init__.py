"""The reference implementation of trainspec on JAX/XLA.

The public entry points: `load_spec`, `build_mesh`, `wrap`, `loss_step`, `grad_step`,
`Stages` and `pipelined` (a model's blocks as a pipeline), and `Run` (the run services of
`trainspec train` for your own loop).
They are imported on first use, so that importing a framework-free module below this package
(the compiled `_xla_ext` registration, say) does not build the whole implementation.
"""
from trainspec.core.entry_points import on_first_use
from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec, default_spec, load_spec

_ENTRY_POINTS = {
    "build_mesh": "trainspec.jax.mesh",
    "WrappedStep": "trainspec.jax.step",
    "loss_step": "trainspec.jax.step_forms",
    "grad_step": "trainspec.jax.step_forms",
    "wrap": "trainspec.jax.wrapping",  # a WrappedStep, or a SemiSyncStep under `[semi_sync]`
    "Run": "trainspec.jax.run",
    "Stages": "trainspec.jax.pipeline",  # a model's stage boundaries, for a pipeline axis
    "pipelined": "trainspec.jax.pipeline",
}

__all__ = ["Spec", "UserInputError", "default_spec", "load_spec", *_ENTRY_POINTS]
__getattr__, __dir__ = on_first_use(__name__, _ENTRY_POINTS, __all__)
