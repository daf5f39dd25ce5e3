"""A user's own flax model over a pipeline axis (docs/wrapping.md, "Pipeline"): its stage
boundaries named with `trainspec.jax.Stages`, it trains with the losses of the same model
without a pipeline; a loss that names none is refused in one line naming the axis, never run
replicated on every stage; the schedule the loss runs is the one a run records."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

from trainspec.core.errors import UserInputError
from trainspec.core.pipeline.schedule import bubble_formula, run_record
from trainspec.core.pipeline.ticks import timeline
from trainspec.core.spec import load_spec
from trainspec.jax import Stages, loss_step, pipelined, wrap

FEATURES, WIDTH, BLOCKS, ROWS = 8, 16, 4, 16
PIPELINE = 'mesh.axes={stage={role="pipeline",size=2},data={size=4}}'
OPTIMIZER = optax.adam(1e-2)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.tanh(nn.Dense(WIDTH)(x))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH, name="embed")(x)
        for i in range(BLOCKS):
            x = Block(name=f"block_{i}")(x)
        return nn.Dense(1, name="out")(x)[:, 0]


def squared_error(prediction, batch):
    error = prediction - batch["y"]
    return jnp.sum(error**2), jnp.float32(error.size)


def plain_loss(params, batch):
    return (*squared_error(Net().apply({"params": params}, batch["x"]), batch), {})


NET_STAGES = Stages(
    embed=lambda params, batch: nn.Dense(WIDTH).apply({"params": params["embed"]}, batch["x"]),
    block=lambda params, x: Block().apply({"params": params}, x),
    blocks=[f"block_{i}" for i in range(BLOCKS)],
    head_loss=lambda params, y, batch: squared_error(
        nn.Dense(1).apply({"params": params["out"]}, y)[:, 0], batch))


def spec_of(*extra: str):
    # model.n_layers: the spec's pipeline checks count the stages' layers by it
    return load_spec(None, [f"batch.global_batch={ROWS}", f"batch.micro_batch={ROWS}",
                            f"model.n_layers={BLOCKS}", "metrics.gns=false", *extra])


def init(rng):
    params = Net().init(rng, jnp.zeros((1, FEATURES)))["params"]
    return TrainState.create(apply_fn=None, params=params, tx=OPTIMIZER)


def losses(step, steps: int = 3) -> list[float]:
    state, out = step.init(init, jax.random.key(0)), []
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
        state, metrics = step(state, {"x": x, "y": np.sin(x.sum(axis=1))})
        out.append(float(metrics["loss"]))
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_users_model_named_in_stages_trains_as_without_a_pipeline(schedule):
    spec = spec_of(PIPELINE, f'pipeline.schedule="{schedule}"')
    piped = wrap(loss_step(pipelined(NET_STAGES, spec, 2, "stage")), spec)
    plain = wrap(loss_step(plain_loss), spec_of("mesh.axes={data={size=8}}"))
    np.testing.assert_allclose(losses(piped), losses(plain), rtol=0, atol=1e-6)


@pytest.mark.parametrize("step_fn", [loss_step(plain_loss), lambda state, batch: (state, {})],
                         ids=["loss_step", "opaque"])
def test_a_step_without_stages_is_refused_naming_the_pipeline_axis(step_fn):
    with pytest.raises(UserInputError, match=r"^mesh\.axes\.stage\.size: 2 pipeline stages "
                                             r"need a loss built with trainspec\.jax\.pipelined"):
        wrap(step_fn, spec_of(PIPELINE))


def test_a_loss_built_for_another_stage_count_is_refused():
    spec = spec_of('mesh.axes={stage={role="pipeline",size=4},data={size=2}}')
    with pytest.raises(UserInputError, match=r"^mesh\.axes\.stage\.size: .* for 2 stages"):
        wrap(loss_step(pipelined(NET_STAGES, spec_of(PIPELINE), 2, "stage")), spec)


def test_blocks_that_do_not_split_evenly_are_refused_naming_them():
    three = Stages(NET_STAGES.embed, NET_STAGES.block, NET_STAGES.blocks[:3],
                   NET_STAGES.head_loss)
    with pytest.raises(UserInputError, match=r"^Stages\.blocks: 3 blocks do not split"):
        pipelined(three, spec_of(PIPELINE), 2, "stage")


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_the_loss_runs_the_schedule_a_run_records(schedule, virtual):
    # the record (trainspec.core.run: run_record) is the slot list of the core's schedule; the
    # loss's tick tables, read back as slots, are that list: what runs is what is recorded
    spec = spec_of(PIPELINE, f'pipeline.schedule="{schedule}"', "pipeline.microbatches=2",
                   f"pipeline.virtual_stages={virtual}")
    loss = pipelined(NET_STAGES, spec, 2, "stage")
    executed = timeline(loss.ticks, virtual)
    record = run_record(spec, {"stage": 2, "data": 4})
    assert [" ".join(map(str, row)) for row in executed.slots] == record["slots"]
    assert executed.idle_fraction() == record["idle_fraction"] == pytest.approx(
        bubble_formula(schedule, 2, 2, virtual))
