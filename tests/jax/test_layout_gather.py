"""layout.gathered_for_use: one all-gather over fsdp serves the forward and the backward, the
gradient comes back in the stored layout, and the values are the plain matmul's."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from trainspec.jax.layout import gathered_for_use

RULES = [("batch", "fsdp"), ("embed", "fsdp"), ("mlp", None)]
EMBED, MLP, ROWS = 16, 8, 8


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ gathered_for_use(w, ("embed", "mlp"))) ** 2)


def _inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((EMBED, MLP)).astype(np.float32),
            rng.standard_normal((ROWS, EMBED)).astype(np.float32))


def test_outside_a_mesh_the_weight_is_returned_as_it_is():
    w, _ = _inputs()
    assert gathered_for_use(w, ("embed", "mlp")) is w


def _mesh(axis_type):
    return jax.make_mesh((4,), ("fsdp",), axis_types=(axis_type,), devices=jax.devices()[:4])


def test_on_an_explicit_mesh_the_weight_is_returned_as_it_is():
    w, _ = _inputs()
    with jax.set_mesh(_mesh(AxisType.Explicit)), nn.logical_axis_rules(RULES):
        assert gathered_for_use(w, ("embed", "mlp")) is w


def test_one_gather_the_stored_layout_for_the_gradient_and_the_float64_values():
    w, x = _inputs()
    mesh = _mesh(AxisType.Auto)
    stored = NamedSharding(mesh, P("fsdp", None))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        step = jax.jit(jax.value_and_grad(_loss), in_shardings=(stored, stored))
        compiled = step.lower(w, x).compile()
        loss, grad = step(jax.device_put(w, stored), jax.device_put(x, stored))

    # The weight is gathered whole once (f32[16,8]), for the forward and the backward alike.
    gathers = re.findall(r"= f32\[(\d+),(\d+)\]\{[^}]*\} all-gather\(", compiled.as_text())
    assert gathers.count((str(EMBED), str(MLP))) == 1, gathers
    assert grad.sharding.is_equivalent_to(stored, grad.ndim), grad.sharding

    # float64 reference: d/dW sum(tanh(xW)^2) = x^T g(y), y = tanh(xW), g(y) = 2y(1 - y^2).
    # float32 bounds: y is off by at most (EMBED + 1) eps |x||W| (the dot product's sequential
    # bound, tanh's own rounding; tanh and |g'| <= 2 carry it on), and the gradient's row sum
    # adds ROWS eps |x|^T |g|.
    x64, w64, eps = x.astype(np.float64), w.astype(np.float64), np.finfo(np.float32).eps
    y = np.tanh(x64 @ w64)
    g = 2 * y * (1 - y ** 2)
    y_err = (EMBED + 1) * eps * (np.abs(x64) @ np.abs(w64) + 1)
    grad_err = np.abs(x64).T @ (2 * y_err + ROWS * eps * np.abs(g))
    assert abs(loss - np.sum(y ** 2)) <= np.sum(2 * y_err) + ROWS * MLP * eps * np.sum(y ** 2)
    assert np.all(np.abs(grad - x64.T @ g) <= grad_err)
