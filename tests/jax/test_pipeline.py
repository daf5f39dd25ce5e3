"""The reference model with a pipeline axis (trainspec.jax.pipeline): under each schedule the
core generates, the same losses as without one from the same initial parameters, the same loss
sums and gradients under a ragged mask (the token-weighted rule), the same under the ext
backend, whose custom calls then carry the stages' traffic, and what the JAX implementation
refuses by name."""
from __future__ import annotations

import re

import flax.linen as nn
import jax
import numpy as np
import pytest

from trainspec.core.capabilities import Request
from trainspec.core.data import ByteBatches
from trainspec.core.mesh import resolve_mesh
from trainspec.core.spec import load_spec
from trainspec.jax.capabilities import JAX
from trainspec.jax.models.transformer import next_token_loss
from trainspec.jax.pipeline import pipelined_loss
from trainspec.jax.pipeline_params import whole_arrays
from trainspec.jax.train import build_job

SMALL = ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
         "batch.seq_len=16", "batch.global_batch=16", "batch.micro_batch=8"]
STEPS = 10
pytestmark = pytest.mark.slow  # five layouts compiled and ten steps each


def spec_of(axes: str, *extra: str):
    return load_spec(None, [*SMALL, f"mesh.axes={{{axes}}}", *extra])


def losses(spec, job=None) -> list[float]:
    job = job or build_job(spec)
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    state, out = job.state, []
    for i in range(STEPS):
        state, metrics = job.step(state, data.batch(i))
        out.append(float(metrics["loss"]))
    return out


@pytest.fixture(scope="module")
def unpipelined() -> list[float]:
    return losses(spec_of("data={size=2},fsdp={size=2},tensor={size=2}"))


@pytest.mark.parametrize("axes, schedule", [
    ('data={size=2},stage={role="pipeline",size=2},tensor={size=2}', "1f1b"),
    ('fsdp={size=2},stage={role="pipeline",size=4},data={size=1},tensor={size=1}', "1f1b"),
    ('data={size=2},stage={role="pipeline",size=2},tensor={size=2}', "interleaved_1f1b"),
    ('stage={role="pipeline",size=4},data={size=2}', "gpipe"),
], ids=["data2-pipeline2-tensor2-1f1b", "fsdp2-pipeline4-1f1b",
        "data2-pipeline2-tensor2-interleaved", "pipeline4-data2-gpipe"])
def test_ten_steps_equal_the_unpipelined_run(unpipelined, axes, schedule):
    # two accumulation micro-batches of 8 sequences, each split into as many pipeline
    # micro-batches as stages per batch shard (interleaved: 2 virtual stages of one layer
    # each); the same seed: the same initial parameters
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    pipelined = losses(spec_of(axes, f'pipeline.schedule="{schedule}"',
                               f"pipeline.virtual_stages={virtual}"))
    np.testing.assert_allclose(pipelined, unpipelined, rtol=0, atol=1e-5)


def test_under_the_ext_backend_its_custom_calls_carry_the_stages_traffic(unpipelined):
    # the permutes and the pipeline's sums are xla_ext custom calls, XLA's own only what the
    # partitioner adds after the pipeline (the embedding's gradient, the norm's squares)
    spec = spec_of('stage={role="pipeline",size=2},data={size=4}', 'collectives.backend="ext"')
    job = build_job(spec)
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    hlo = job.step.compile(job.state, job.step.shard_batch(data.batch(0))).as_text()
    calls = re.findall(r'custom_call_target="trainspec_(\w+)"', hlo)
    assert set(calls) == {"permute", "all_reduce"}, calls
    assert not re.search(r"\scollective-permute(-start)?\(", hlo)
    np.testing.assert_allclose(losses(spec, job), unpipelined, rtol=0, atol=1e-5)


def test_a_ragged_mask_gives_the_same_loss_sums_and_gradients():
    spec = spec_of('stage={role="pipeline",size=2},data={size=2},tensor={size=2}',
                   "pipeline.microbatches=4")
    job = build_job(spec)
    batch = ByteBatches(16, 8, 0).batch(0)
    # row r keeps its first r + 3 tokens
    mask = (np.arange(16)[None, :] < np.arange(8)[:, None] + 3).astype(batch["mask"].dtype)
    batch = {**batch, "mask": mask}
    params = whole_arrays(job.state.params)  # the model's own tree: the loss stages it

    def plain(p, b):
        logits = job.model.apply({"params": p}, b["inputs"])
        return (*next_token_loss(logits, b["targets"], b["mask"]), {})

    piped = pipelined_loss(job.model, spec, 2, "stage")

    def sums_and_grads(loss_fn):
        def mean(p):
            loss_sum, tokens, _ = loss_fn(p, batch)
            return loss_sum / tokens, (loss_sum, tokens)
        return jax.jit(jax.value_and_grad(mean, has_aux=True))(params)

    with jax.set_mesh(job.step.mesh), nn.logical_axis_rules(job.step.rules):
        ((_, (plain_sum, plain_tokens)), plain_grads), ((_, (sum_, tokens)), grads) = (
            sums_and_grads(plain), sums_and_grads(piped))
    assert float(tokens) == float(plain_tokens) == float(mask.sum())
    np.testing.assert_allclose(sum_, plain_sum, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("extra, field, words", [
    (['pipeline.schedule="zero_bubble_v"'], "pipeline.schedule", "'zero_bubble_v'"),
    (["pipeline.layers_per_stage=[1, 3]"], "pipeline.layers_per_stage", "equal stages"),
    (['collectives.compression="bf16"'], "collectives.compression", "pipeline axis to be 1"),
    (['collectives.backend="hierarchical"'], "collectives.backend", 'use backend = "xla"'),
    (["semi_sync.inner_steps=4"], "semi_sync.inner_steps", "pipeline axis to 1"),
])
def test_what_the_jax_pipeline_does_not_run_is_refused_by_name(extra, field, words):
    spec = spec_of('stage={role="pipeline",size=2},data={size=4}', *extra)
    lines = JAX.refusals(Request(spec, resolve_mesh(spec, 8)))
    assert any(line.startswith(f"{field}: ") and words in line for line in lines), lines
    model = JAX.refusals(Request(spec, resolve_mesh(spec, 8), {"--model": "m.py:make"}))
    assert any(line.startswith("--model: ") for line in model)
