"""The backend-neutral collectives API: one op set, backends chosen per call or by a default.

Every op is called inside `jax.shard_map` over named mesh axes (a name, or a tuple of names for
a group spanning several axes, ranked row-major like `lax.axis_index`). Semantics are those of the
tiled lax collectives; the checks below run at trace time for every backend so that a bad call
fails the same way whichever backend is chosen.

Backend selection, highest priority first: the `backend=` argument; the innermost
`use_backend(...)` block (what the train step uses for the spec's `collectives.backend`); the
process default set by `set_default_backend` ("xla" unless changed).
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
from types import ModuleType

import jax.numpy as jnp
import numpy as np
from jax import lax

from spec_jax.errors import UserInputError

# Backend name -> module implementing the six ops. Imported on first use, so the xla backend
# works on an install where the compiled extension (needed by "ext") is missing.
BACKEND_MODULES = {
    "xla": "spec_jax.collectives.xla",
    "ext": "spec_jax.collectives.ext",
    "hierarchical": "spec_jax.collectives.hierarchical",
}

# The guarantee level each backend declares (definitions: docs/spec.md, section 4). xla: XLA documents no reduction order, and NCCL picks ring or tree
# algorithms by size and topology, so no bitwise promise can be made for it in general.
# hierarchical: its cross-process stage is the native runtime (gloo, NCCL), so it can promise no
# more than xla does, although its in-process stages are ext's rank-order sums.
GUARANTEE_LEVELS = {"xla": "nondeterministic", "ext": "deterministic",
                    "hierarchical": "nondeterministic"}

ALL_REDUCE_OPS = ("sum", "mean", "max", "min")
REDUCE_SCATTER_OPS = ("sum", "mean")

_default_backend = "xla"
_scoped_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "trainspec_collectives_backend", default=None
)


def _check_name(name: str) -> str:
    if name not in BACKEND_MODULES:
        raise UserInputError(
            f"unknown collectives backend {name!r}; known: {', '.join(BACKEND_MODULES)}"
        )
    return name


def set_default_backend(name: str) -> None:
    """Process-wide default backend (used when no `backend=` and no `use_backend` applies)."""
    global _default_backend
    _default_backend = _check_name(name)


@contextlib.contextmanager
def use_backend(name: str):
    """Within this block (while tracing), ops without `backend=` use `name`."""
    token = _scoped_backend.set(_check_name(name))
    try:
        yield
    finally:
        _scoped_backend.reset(token)


def current_backend() -> str:
    return _scoped_backend.get() or _default_backend


def get_backend(name: str | None = None) -> ModuleType:
    """The module implementing backend `name` (default: `current_backend()`)."""
    name = _check_name(name or current_backend())
    try:
        return importlib.import_module(BACKEND_MODULES[name])
    except ImportError as err:
        raise UserInputError(f"collectives backend {name!r} is not available: {err}") from err


def guarantee_level(name: str) -> str:
    return GUARANTEE_LEVELS[_check_name(name)]


# ---- trace-time checks shared by all backends -------------------------------------------------


def _check_timeout(timeout_s) -> None:
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def _check_op(name: str, op: str, allowed: tuple[str, ...], x) -> None:
    if op not in allowed:
        raise ValueError(f"{name}: op must be one of {allowed}, got {op!r}")
    # lax.pmean of int32 silently returns float32; we refuse instead of changing the dtype.
    if op == "mean" and not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        raise ValueError(f"{name}: op='mean' needs a floating dtype, got {jnp.result_type(x)}; "
                         "use op='sum' and divide")


def _check_axis(name: str, x, axis: int, what: str) -> int:
    ndim = jnp.ndim(x)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: {what}={axis} is out of range for an operand of rank {ndim}")
    return axis % ndim


def _check_divisible(name: str, x, axis: int, what: str, axis_name) -> None:
    axis = _check_axis(name, x, axis, what)
    n, size = lax.axis_size(axis_name), jnp.shape(x)[axis]
    if size % n:
        raise ValueError(f"{name}: operand dimension {axis} ({what}) has size {size}, "
                         f"not divisible by the group size {n} of axis {axis_name!r}")


# ---- the op set -------------------------------------------------------------------------------


def all_reduce(x, axis_name, op="sum", *, timeout_s=None, backend=None):
    """Every member gets the reduction (sum, mean, max or min) of all members' `x`."""
    _check_op("all_reduce", op, ALL_REDUCE_OPS, x)
    _check_timeout(timeout_s)
    return get_backend(backend).all_reduce(x, axis_name, op, timeout_s=timeout_s)


def reduce_scatter(x, axis_name, *, scatter_dimension=0, op="sum", timeout_s=None, backend=None):
    """Member k gets block k (along `scatter_dimension`) of the sum/mean over members."""
    _check_op("reduce_scatter", op, REDUCE_SCATTER_OPS, x)
    _check_divisible("reduce_scatter", x, scatter_dimension, "scatter_dimension", axis_name)
    _check_timeout(timeout_s)
    return get_backend(backend).reduce_scatter(
        x, axis_name, scatter_dimension=scatter_dimension, op=op, timeout_s=timeout_s
    )


def all_gather(x, axis_name, *, axis=0, timeout_s=None, backend=None):
    """Every member gets all members' `x` concatenated along `axis`, in rank order."""
    _check_axis("all_gather", x, axis, "axis")
    _check_timeout(timeout_s)
    return get_backend(backend).all_gather(x, axis_name, axis=axis, timeout_s=timeout_s)


def all_to_all(x, axis_name, split_axis, concat_axis, *, timeout_s=None, backend=None):
    """Member k gets block k (along `split_axis`) of every member, concatenated on `concat_axis`."""
    _check_divisible("all_to_all", x, split_axis, "split_axis", axis_name)
    _check_axis("all_to_all", x, concat_axis, "concat_axis")
    _check_timeout(timeout_s)
    return get_backend(backend).all_to_all(
        x, axis_name, split_axis, concat_axis, timeout_s=timeout_s
    )


def broadcast(x, axis_name, root=0, *, timeout_s=None, backend=None):
    """Every member gets member `root`'s `x`."""
    n = lax.axis_size(axis_name)
    if not (isinstance(root, (int, np.integer)) and 0 <= root < n):
        raise ValueError(f"broadcast: root must be an int in [0, {n}), got {root!r}")
    root = int(root)  # a static attribute for every backend
    _check_timeout(timeout_s)
    return get_backend(backend).broadcast(x, axis_name, root, timeout_s=timeout_s)


def permute(x, axis_name, perm, *, timeout_s=None, backend=None):
    """Member dst gets member src's `x` for each (src, dst) in `perm`; the others get zeros."""
    n = lax.axis_size(axis_name)
    perm = tuple((int(s), int(d)) for s, d in perm)
    for pair in perm:
        if not all(0 <= r < n for r in pair):
            raise ValueError(f"permute: pair {pair} has a rank outside [0, {n})")
    for side, ranks in (("sources", [s for s, _ in perm]), ("destinations", [d for _, d in perm])):
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"permute: {side} must be unique, got perm={perm}")
    _check_timeout(timeout_s)
    return get_backend(backend).permute(x, axis_name, perm, timeout_s=timeout_s)
