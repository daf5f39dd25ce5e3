"""What a new user of wrap() meets, each with a one-line error or a documented behaviour
(docs/wrapping.md, "What wrap() checks and does")."""
import re
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import PartitionSpec as P

from trainspec.jax import default_spec, load_spec, wrap
from trainspec.core.errors import UserInputError
from trainspec.core.layout_rules import DEFAULT_ROLE_RULES

ROWS, FEATURES, OUT = 16, 4, 8
DENSE_NAMES = ("embed", "mlp")


class Dense(nn.Module):
    boxed: bool = True  # kernel carries logical axis names (nn.with_logical_partitioning)
    names: tuple[str, str] = DENSE_NAMES

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        if self.boxed:
            init = nn.with_logical_partitioning(init, self.names)
        return nn.Dense(OUT, kernel_init=init)(x)


MODEL, SGD = Dense(), optax.sgd(0.1)  # made once, outside init_fn


def _init(key):
    params = MODEL.init(key, jnp.zeros((1, FEATURES)))["params"]
    return TrainState.create(apply_fn=MODEL.apply, params=params, tx=SGD)


def _step(state, batch):
    def loss(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def _spec(**axes):
    sizes = {"data": -1, "fsdp": 1, "tensor": 1, **axes}
    return load_spec({"mesh": {"axes": {a: {"size": s} for a, s in sizes.items()}},
                      "batch": {"global_batch": ROWS, "seq_len": 6}})


def _batch(rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, FEATURES)).astype(np.float32),
            "y": rng.standard_normal((rows, OUT)).astype(np.float32)}


@pytest.fixture(scope="module")
def data8():
    """The step on 8 data-parallel devices, compiled once for the module."""
    step = wrap(_step, _spec())
    state, _ = step(step.init(_init, jax.random.key(0)), _batch())
    return step, state


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_fresh_objects_inside_init_fn_name_the_static_field():
    def init_building_everything(key):  # the model and optimizer are new objects each call
        model = Dense()
        params = model.init(key, jnp.zeros((1, FEATURES)))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    with pytest.raises(UserInputError) as err:
        wrap(_step, _spec()).init(init_building_everything, jax.random.key(0))
    message = _one_line(err)
    assert "state.apply_fn" in message and "outside init_fn" in message


def test_an_unknown_logical_axis_names_the_leaf_and_the_known_axes():
    """A kernel annotated ("embed", "hidden"): "hidden" has no rule. One line naming the
    leaf, the axis and the known ones (it was a traceback from inside the layout code); the
    rule the message suggests makes it work."""
    model = Dense(names=("embed", "hidden"))

    def init_fn(key):
        params = model.init(key, jnp.zeros((1, FEATURES)))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=SGD)

    with pytest.raises(UserInputError) as err:
        wrap(_step, _spec(tensor=2)).plan(init_fn, jax.random.key(0))
    assert _one_line(err) == (
        "state.params['Dense_0']['kernel']: logical axis 'hidden' has no rule (known: batch, "
        "length, embed, mlp, heads, kv, vocab, layers, expert); add it to layout.rules, e.g. "
        "layout.rules.hidden = []")
    step = wrap(_step, load_spec(_spec(tensor=2), ['layout.rules.hidden = ["tensor"]']))
    state = step.init(init_fn, jax.random.key(0))
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(None, "tensor")


def test_wrapping_doc_lists_every_default_logical_axis_and_its_mesh_axes():
    """docs/wrapping.md's table of logical axis names is the default rule set, row for row."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "wrapping.md").read_text()
    assert "\n## Logical axis names\n" in doc
    section = doc.split("\n## Logical axis names\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|$", section, re.M)
    listed = {name: tuple(re.findall(r"`(\w+)`", axes)) for name, axes in rows}
    assert list(listed.items()) == list(DEFAULT_ROLE_RULES.items())


def test_default_spec_wraps_an_opaque_step():
    assert wrap(_step, default_spec()).spec.batch.accumulation_steps == 1
    accumulating = load_spec(default_spec(), ["batch.micro_batch=16"])
    with pytest.raises(UserInputError, match=r"batch\.micro_batch = 32 to wrap it as it is"):
        wrap(_step, accumulating)


@pytest.mark.parametrize("devices", [1, 2])
def test_devices_argument_runs_on_fewer_devices_than_present(devices):
    step = wrap(_step, _spec(), devices=devices)
    assert step.mesh.devices.size == devices and step.mesh.shape["data"] == devices
    state, metrics = step(step.init(_init, jax.random.key(0)), _batch())
    assert np.isfinite(float(metrics["loss"]))
    assert len(state.params["Dense_0"]["kernel"].sharding.device_set) == devices


def test_a_mesh_must_name_the_specs_axes():
    """jax.make_mesh((8,), ("data",)) beside a spec with fsdp and tensor axes: one line naming
    the argument (it was a KeyError deep in the layout code)."""
    with pytest.raises(UserInputError) as err:
        wrap(_step, _spec(), mesh=jax.make_mesh((8,), ("data",)))
    assert _one_line(err).startswith("mesh: its axes (data) are not the spec's mesh.axes "
                                     "(data, fsdp, tensor)")


def test_a_mesh_naming_the_specs_axes_trains():
    """A user's own mesh (jax.make_mesh's default axis type) with the spec's axis names."""
    step = wrap(_step, _spec(), mesh=jax.make_mesh((8, 1, 1), ("data", "fsdp", "tensor")))
    _, metrics = step(step.init(_init, jax.random.key(0)), _batch())
    assert np.isfinite(float(metrics["loss"]))


def test_batch_rows_must_be_the_global_batch(data8):
    step, state = data8
    for rows in (8, 12):  # 12 rows would not even split over the 8 batch shards
        with pytest.raises(UserInputError) as err:
            step(state, _batch(rows))
        message = _one_line(err)
        assert message.startswith("batch.global_batch:")
        assert f"batch['x'] has {rows} rows" in message and "is 16" in message


def test_token_arrays_must_have_seq_len(data8):
    step, _ = data8
    tokens = np.zeros((ROWS, 5), np.int32)  # the spec says seq_len 6
    with pytest.raises(UserInputError) as err:
        step.shard_batch({**_batch(), "tokens": tokens})
    message = _one_line(err)
    assert message.startswith("batch.seq_len:") and "length 5" in message
    step.shard_batch({**_batch(), "tokens": np.zeros((ROWS, 6), np.int32)})  # right length


def test_batch_committed_to_one_device_is_placed_like_a_host_array(data8):
    step, state = data8
    host = _batch(seed=1)
    on_one = jax.device_put(host, jax.devices()[0])
    placed = step.shard_batch(on_one)
    assert placed["x"].sharding == step.batch_sharding(2)
    np.testing.assert_array_equal(np.asarray(placed["x"]), host["x"])
    state, metrics = step(state, on_one)
    assert np.isfinite(float(metrics["loss"]))


def test_unboxed_params_warn_with_the_count_when_the_mesh_could_shard_them():
    def init_unboxed(key):  # as many examples' setup does: the logical names are dropped
        return nn.meta.unbox(_init(key))

    with pytest.warns(UserWarning, match=r"init_fn: 2 of 3 state leaves carry no logical "
                                         r"axis names.*mesh axes fsdp"):
        wrap(_step, _spec(fsdp=2)).plan(init_unboxed, jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrap(_step, _spec(fsdp=2)).plan(_init, jax.random.key(0))  # boxed: sharded, no warning
        wrap(_step, _spec()).plan(init_unboxed, jax.random.key(0))  # data only: replicated anyway


def test_a_step_returning_nan_params_keeps_the_old_state_under_skip():
    def poisoned(state, batch):
        new_state, metrics = _step(state, batch)
        params = jax.tree.map(lambda p: p * jnp.nan, new_state.params)
        return new_state.replace(params=params), metrics

    step = wrap(poisoned, load_spec(_spec(), ["health.nan.policy=skip"]))
    state = step.init(_init, jax.random.key(0))
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step(state, _batch())
    assert int(state.step) == 0  # the update was dropped whole, step counter included
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)
    assert int(metrics["nonfinite"]) == 1 and int(metrics["skipped_steps"]) == 1
