"""Conformance suite for trainspec.jax.collectives: every backend must pass it unchanged.

Run one backend with `pytest tests/conformance -k xla` (or `-k ext`). Each test compiles one
(op, dtype, shape, layout) program. The layouts, cases, inputs, float64 references and
tolerances are the spec's (trainspec.core.conformance, trainspec.core.collectives_reference);
this file runs them through jax. float64 cases run under a scoped `jax.enable_x64(True)`, so
the rest of the test session keeps jax's default 32-bit types.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import Mesh, PartitionSpec as P

from trainspec.jax import collectives
from trainspec.core import collectives_reference as ref
from trainspec.core import conformance
from trainspec.core.conformance import (
    CASES, DTYPES, GROUP_ORDER, ILLEGAL, ILLEGAL_MEAN, LAYOUTS, LINEAR_CASES, Layout,
    expected as _expected,
)

pytestmark = pytest.mark.slow

# ---- backends, layouts, dtypes ----------------------------------------------------------------

_EXT_PRESENT = importlib.util.find_spec("trainspec.jax.collectives.ext") is not None
BACKENDS = [
    pytest.param("xla", id="xla"),
    # Skipped only while the module does not exist; once it does, import errors fail loudly.
    pytest.param("ext", id="ext", marks=pytest.mark.skipif(
        not _EXT_PRESENT, reason="trainspec/jax/collectives/ext.py does not exist yet")),
]
LAYOUT_PARAMS = [pytest.param(lay, id=lay.name) for lay in LAYOUTS]


@functools.cache
def _mesh(shape, axes) -> Mesh:
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), axes)


def _x64(dtype):
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


def _host(result) -> np.ndarray:
    """A result on the host. Run across processes (multiprocess_worker.py), a result spans
    devices of other processes: every process fetches the whole global array."""
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(result, tiled=True))
    return np.asarray(result)


# ---- running a case ---------------------------------------------------------------------------


def _inputs(layout: Layout, local_shape, dtype, salt: str) -> np.ndarray:
    return conformance.inputs(layout, local_shape, dtype, salt).astype(jnp.dtype(dtype))


def _sharded(layout: Layout, fn):
    """jit(shard_map(fn)) over the layout's mesh, fn seeing each member's local block."""
    k = len(layout.mesh_shape)

    def body(block):
        out = fn(block.reshape(block.shape[k:]))
        return out.reshape((1,) * k + out.shape)

    spec = P(*layout.mesh_axes)
    return jax.jit(jax.shard_map(body, mesh=_mesh(layout.mesh_shape, layout.mesh_axes),
                                 in_specs=spec, out_specs=spec, check_vma=False))


def _op(backend, layout, case):
    kwargs = case.resolve(layout.n)[1]
    op = getattr(collectives, case.op)
    return lambda v: op(v, layout.axis_name, backend=backend, **kwargs)


def _check(out: np.ndarray, expected: np.ndarray, tol, dtype, what: str):
    assert out.dtype == jnp.dtype(dtype), f"{what}: dtype {out.dtype}, expected {dtype}"
    assert out.shape == expected.shape, f"{what}: shape {out.shape}, expected {expected.shape}"
    err = np.abs(out.astype(np.float64) - expected)
    bad = err > tol
    if bad.any():
        i = np.argmax(np.where(bad, err - tol, -np.inf))
        pytest.fail(f"{what}: {bad.sum()} of {bad.size} elements out of tolerance; worst at flat "
                    f"index {i}: got {out.flat[i]!r}, want {expected.flat[i]!r}, "
                    f"tolerance {np.broadcast_to(tol, err.shape).flat[i]:.3g}")


# ---- forward: every op x dtype x shape x layout -----------------------------------------------

CASE_DTYPES = [pytest.param(c, d, id=f"{c.id}-{d}") for c in CASES for d in DTYPES
               if not (d == "int32" and c.needs_float)]


@pytest.mark.parametrize("layout", LAYOUT_PARAMS)
@pytest.mark.parametrize("case,dtype", CASE_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, case, dtype, layout):
    x = _inputs(layout, case.resolve(layout.n)[0], dtype, case.id)
    with _x64(dtype):
        out = _host(_sharded(layout, _op(backend, layout, case))(x))
    expected, tol = _expected(layout, case, dtype, x)
    _check(out, expected, tol, dtype, f"{backend} {case.id} {dtype} {layout.name}")


# lax.ppermute numbers a group whose axes are not in mesh order in mesh order (jax 0.10.2): the
# xla backend's permute and broadcast delivered to the wrong members until it translated the
# ranks (xla._ppermute).
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_group_in_non_mesh_order(backend, case):
    test_matches_reference(backend, case, "float32", GROUP_ORDER)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_16bit_sums_accumulate_in_f32(backend, op, dtype):
    """1 + 7 * s with s a quarter ULP at 1: summed in 16 bits in any order, each partial sum
    that contains 1 rounds the small terms away (or a pair of them to even); summed in float32
    the total is exact and rounds once to the nearest 16-bit value."""
    layout = LAYOUTS[0]
    small = 2.0 ** -(jnp.finfo(dtype).nmant + 2)
    x = np.full(layout.mesh_shape + (8,), small, jnp.dtype(dtype))  # a group of 8 members
    x.reshape(-1, 8)[0] = 1.0
    fn = lambda v: getattr(collectives, op)(v, layout.axis_name, backend=backend)  # noqa: E731
    out = _host(_sharded(layout, fn)(x)).astype(np.float64)
    want = float(np.asarray(1 + 7 * small, jnp.dtype(dtype)))
    assert want != 1.0 and np.all(out == want), (out.ravel()[:8], want)


# ---- errors at trace time -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", [LAYOUT_PARAMS[0], LAYOUT_PARAMS[1]])
@pytest.mark.parametrize("op,shape,kwargs,message", ILLEGAL,
                         ids=[f"{c[0]}-{c[3].split()[0]}-{i}" for i, c in enumerate(ILLEGAL)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rejects_illegal_calls(backend, op, shape, kwargs, message, layout):
    x = np.zeros(layout.mesh_shape + shape(layout.n), np.float32)
    fn = functools.partial(getattr(collectives, op), axis_name=layout.axis_name, backend=backend,
                           **kwargs(layout.n))
    with pytest.raises(ValueError, match=message):
        _sharded(layout, fn).lower(x)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mean_of_integers_is_rejected(backend, op):
    layout = LAYOUTS[0]
    fn = functools.partial(getattr(collectives, op), axis_name=layout.axis_name, op="mean",
                           backend=backend)
    with pytest.raises(ValueError, match=ILLEGAL_MEAN):
        _sharded(layout, fn).lower(np.zeros(layout.mesh_shape + (8,), np.int32))


# ---- gradients and vmap (float32) ---------------------------------------------------------------

GRAD_LAYOUTS = [LAYOUT_PARAMS[0], LAYOUT_PARAMS[1], LAYOUT_PARAMS[3], LAYOUT_PARAMS[4]]


@functools.cache
def _gradient(backend, case, layout):
    """d/dx sum(w * op(x)) through the backend, and the analytic value with its tolerance."""
    x = _inputs(layout, case.resolve(layout.n)[0], "float32", case.id)
    expected, _ = _expected(layout, case, "float32", x)
    w = _inputs(layout, expected.shape[len(layout.mesh_shape):], "float32", "w" + case.id)
    forward = _sharded(layout, _op(backend, layout, case))
    got = _host(jax.jit(jax.grad(lambda v: jnp.sum(w * forward(v))))(x))

    kwargs = case.resolve(layout.n)[1]
    k = len(layout.mesh_shape)
    w_blocks, back = ref.to_groups(w.astype(np.float64), k, layout.group_dims)
    want = back(ref.adjoint(case.op, kwargs, w_blocks))
    if case.op in ("all_to_all", "permute") or case.id.startswith("reduce_scatter-sum"):
        tol = 0.0  # their adjoints only move values
    else:  # Higham's bound over the terms each gradient element sums, as for forward sums
        nu = layout.n * 2.0**-24
        tol = nu / (1 - nu) * back(ref.adjoint(case.op, kwargs, np.abs(w_blocks))) \
            + ref.ulp("float32", want)
    return got, want, np.broadcast_to(tol, want.shape)


@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_matches_analytic(backend, case, layout):
    got, want, tol = _gradient(backend, case, layout)
    _check(got, want, tol, "float32", f"grad {backend} {case.id} {layout.name}")


@pytest.mark.skipif(not _EXT_PRESENT, reason="needs both backends")
@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.id)
def test_gradients_agree_across_backends(case, layout):
    x_got, _, x_tol = _gradient("xla", case, layout)
    e_got, _, e_tol = _gradient("ext", case, layout)
    _check(e_got, x_got.astype(np.float64), x_tol + e_tol, "float32",
           f"grad ext vs xla {case.id} {layout.name}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_inside_shard_map(backend, case):
    """vmap over a batch of 3 operands per member = the op on each batch element."""
    layout = LAYOUTS[1]
    k = len(layout.mesh_shape)
    x = _inputs(layout, (3, *case.resolve(layout.n)[0]), "float32", case.id)
    out = _host(_sharded(layout, jax.vmap(_op(backend, layout, case)))(x))
    per_item = [_expected(layout, case, "float32", x[(slice(None),) * k + (b,)]) for b in range(3)]
    expected = np.stack([e for e, _ in per_item], axis=k)
    tol = np.stack([t for _, t in per_item], axis=k)
    _check(out, expected, tol, "float32", f"vmap {backend} {case.id}")


# ---- guarantee levels -----------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS
                                     if collectives.guarantee_level(b.values[0]) == "deterministic"])
def test_deterministic_backends_are_bitwise_repeatable(backend, op):
    """A 'deterministic' backend gives identical bits on every run, whichever device thread
    arrives first (on 2 cores the 8 device threads arrive in a different order run to run).
    The data mixes magnitudes and signs so that any change of summation order shows."""
    layout = LAYOUTS[0]
    rng = np.random.default_rng(0)
    shape = layout.mesh_shape + (1 << 14,)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    fn = _sharded(layout, lambda v: getattr(collectives, op)(v, layout.axis_name, backend=backend))
    first = _host(fn(x))
    for _ in range(10):
        np.testing.assert_array_equal(_host(fn(x)).view(np.uint32), first.view(np.uint32))


@pytest.mark.parametrize("case", [c for c in CASES if c.op in ("all_gather", "broadcast",
                                                                 "permute", "all_to_all")],
                         ids=lambda c: c.id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_data_movement_preserves_bits(backend, case):
    """Ops that only move data keep every bit: -0.0 stays negative, NaN and inf survive (a
    broadcast built from arithmetic, e.g. a sum with +0.0, would flip -0.0)."""
    layout = LAYOUTS[0]
    x = _inputs(layout, case.resolve(layout.n)[0], "float32", case.id)
    specials = np.array([-0.0, np.inf, -np.inf, np.nan], np.float32)
    x.reshape(-1)[:] = specials[np.arange(x.size) % specials.size]
    out = _host(_sharded(layout, _op(backend, layout, case))(x))
    expected, _ = _expected(layout, case, "float32", x)
    np.testing.assert_array_equal(out.view(np.uint32), expected.astype(np.float32).view(np.uint32))
