"""The backend-neutral collectives API: one op set, backends chosen per call or by a default.

Every op is called inside `jax.shard_map` over named mesh axes (a name, or a tuple of names for
a group spanning several axes, ranked row-major like `lax.axis_index`). Semantics are those of the
tiled lax collectives; the checks below run at trace time for every backend so that a bad call
fails the same way whichever backend is chosen. This module is the one place that validates: the
backend modules are thin and trust the checked, normalised arguments it passes them.

Backend selection, highest priority first: the `backend=` argument; the innermost
`use_backend(...)` block (what the train step traces its loss under, with the spec's
`collectives.backend` and `timeout_s`: the collectives a model makes, such as the experts'
all-to-alls, follow the spec); the process default set by `set_default_backend` ("xla" unless
changed). A `timeout_s=None` takes the innermost block's timeout where it names one. What each backend is and
can do is declared in trainspec.jax.backends.
"""
from __future__ import annotations

import contextlib
import contextvars
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from trainspec.core.collective_calls import check_call
from trainspec.jax.backends import backend

_default_backend = "xla"
# (backend, timeout_s) of the innermost use_backend block
_scope: contextvars.ContextVar[tuple[str, float | None] | None] = contextvars.ContextVar(
    "trainspec_collectives_scope", default=None
)


def set_default_backend(name: str) -> None:
    """Process-wide default backend (used when no `backend=` and no `use_backend` applies)."""
    global _default_backend
    _default_backend = backend(name).name


@contextlib.contextmanager
def use_backend(name: str, timeout_s: float | None = None):
    """Within this block (while tracing), ops without `backend=` use `name`, and ops without
    `timeout_s=` wait `timeout_s` (None: each backend's default)."""
    token = _scope.set((backend(name).name, timeout_s))
    try:
        yield
    finally:
        _scope.reset(token)


def current_backend() -> str:
    scope = _scope.get()
    return scope[0] if scope else _default_backend


def _timeout(timeout_s: float | None) -> float | None:
    """`timeout_s`, or where it is None the innermost use_backend block's."""
    scope = _scope.get()
    return scope[1] if timeout_s is None and scope else timeout_s


def get_backend(name: str | None = None) -> ModuleType:
    """The module implementing backend `name` (default: `current_backend()`), imported on
    first use."""
    return backend(name or current_backend()).ops()


def guarantee_level(name: str) -> str:
    return backend(name).guarantee


# ---- trace-time checks shared by all backends -------------------------------------------------
# Backends receive axes in range as non-negative ints, root as an int, perm as a tuple of int
# pairs, and an operand of a dtype in their SUPPORTED_DTYPES (where they declare one).

# 16-bit floats, which every backend sums in float32 and rounds once (docs/spec.md).
HALF_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_group(name: str, axis_name) -> tuple[str, ...]:
    """The group's axis names: distinct, and manual axes of the `shard_map` being traced."""
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"{name}: axis_name must be a name or a tuple of distinct names, "
                         f"got {axis_name!r}")
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(a for a in mesh.axis_names if a in mesh.manual_axes)
    missing = [a for a in names if a not in manual]
    if missing:
        raise ValueError(f"{name}: axis {missing} is not a manual axis here; call it inside "
                         f"jax.shard_map over a mesh with axes {manual or '(none)'}")
    return names


def _check_dtype(name: str, x, impl: ModuleType):
    """`x` as an array whose dtype the backend supports (`SUPPORTED_DTYPES`; absent: any)."""
    x = jnp.asarray(x)
    supported = getattr(impl, "SUPPORTED_DTYPES", None)
    if supported is not None and x.dtype not in supported:
        raise ValueError(f"{name}: dtype {x.dtype} is not supported by the "
                         f"{impl.__name__.rsplit('.', 1)[-1]} backend "
                         f"(supported: {', '.join(str(d) for d in supported)})")
    return x


def _checked(name: str, x, axis_name, backend, kwargs: dict):
    """(backend module, operand, normalised arguments) after the checks every implementation
    makes (trainspec.core.collective_calls) and this API's own (group, backend dtype)."""
    impl = get_backend(backend)
    _check_group(name, axis_name)
    dtype = jnp.result_type(x)
    kw = check_call(name, jnp.shape(x), str(dtype), bool(jnp.issubdtype(dtype, jnp.inexact)),
                    lax.axis_size(axis_name), axis_name, kwargs)
    return impl, _check_dtype(name, x, impl), kw


# ---- the op set -------------------------------------------------------------------------------


def all_reduce(x, axis_name, op="sum", *, in_place=False, timeout_s=None, backend=None):
    """Every member gets the reduction (sum, mean, max or min) of all members' `x`.

    `in_place=True` lets the result take `x`'s buffer, as nccl-tests' in-place form
    (recvbuff == sendbuff): ext's custom call then writes over its input, so a reduction of a
    buffer that dies with the call (a fused gradient) needs no second one; where `x` is used
    again, XLA copies it first. On xla and hierarchical, XLA places the buffers as it would
    anyway (its CPU all-reduce writes a new buffer, then copies it into a donated input)."""
    timeout_s = _timeout(timeout_s)
    if not isinstance(in_place, bool):
        raise ValueError(f"all_reduce: in_place must be True or False, got {in_place!r}")
    impl, x, kw = _checked("all_reduce", x, axis_name, backend, {"op": op, "timeout_s": timeout_s})
    return impl.all_reduce(x, axis_name, kw["op"], timeout_s=timeout_s, in_place=in_place)


def reduce_scatter(x, axis_name, *, scatter_dimension=0, op="sum", timeout_s=None, backend=None):
    """Member k gets block k (along `scatter_dimension`) of the sum/mean over members."""
    timeout_s = _timeout(timeout_s)
    impl, x, kw = _checked("reduce_scatter", x, axis_name, backend, {
        "op": op, "scatter_dimension": scatter_dimension, "timeout_s": timeout_s})
    return impl.reduce_scatter(x, axis_name, **kw, timeout_s=timeout_s)


def all_gather(x, axis_name, *, axis=0, timeout_s=None, backend=None):
    """Every member gets all members' `x` concatenated along `axis`, in rank order."""
    timeout_s = _timeout(timeout_s)
    impl, x, kw = _checked("all_gather", x, axis_name, backend, {"axis": axis, "timeout_s": timeout_s})
    return impl.all_gather(x, axis_name, **kw, timeout_s=timeout_s)


def all_to_all(x, axis_name, split_axis, concat_axis, *, timeout_s=None, backend=None):
    """Member k gets block k (along `split_axis`) of every member, concatenated on `concat_axis`."""
    timeout_s = _timeout(timeout_s)
    impl, x, kw = _checked("all_to_all", x, axis_name, backend, {
        "split_axis": split_axis, "concat_axis": concat_axis, "timeout_s": timeout_s})
    return impl.all_to_all(x, axis_name, kw["split_axis"], kw["concat_axis"], timeout_s=timeout_s)


def broadcast(x, axis_name, root=0, *, timeout_s=None, backend=None):
    """Every member gets member `root`'s `x`."""
    timeout_s = _timeout(timeout_s)
    impl, x, kw = _checked("broadcast", x, axis_name, backend, {"root": root, "timeout_s": timeout_s})
    return impl.broadcast(x, axis_name, kw["root"], timeout_s=timeout_s)  # root: static


def permute(x, axis_name, perm, *, timeout_s=None, backend=None):
    """Member dst gets member src's `x` for each (src, dst) in `perm`; the others get zeros."""
    timeout_s = _timeout(timeout_s)
    impl, x, kw = _checked("permute", x, axis_name, backend, {"perm": perm, "timeout_s": timeout_s})
    return impl.permute(x, axis_name, kw["perm"], timeout_s=timeout_s)
