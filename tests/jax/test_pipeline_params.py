"""Each pipeline stage holds only its own blocks' parameters and optimizer state
(trainspec.jax.pipeline_params): under interleaving stage s holds model chunks s, s + p, ...;
checkpoints keep one leaf per block, split over the pipeline axis on a free dimension; and the
compiled step moves no block's gradient between stages (before, every block was on every stage
and the step all-to-all'ed and all-reduced their gradients over the pipeline axis), and sums
them over the data replicas once a step (before, once per backward tick)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tiny import tiny_spec
from trainspec.core.data import ByteBatches
from trainspec.jax.metrics.comm import (
    analyze_compiled, axes_of_groups, parse_replica_groups, shape_bytes)
from trainspec.jax.pipeline_params import StageForm, staged_like, whole_abstract, whole_arrays
from trainspec.jax.train import build_abstract_job

STAGES, VIRTUAL, BLOCKS, WIDTH = 2, 2, 8, 4


@pytest.fixture(scope="module")
def mesh():
    # the mesh as trainspec builds it: axes of type Auto, XLA places what the model leaves open
    return Mesh(np.asarray(jax.devices()).reshape(STAGES, 4), ("stage", "data"))


def params_of_blocks():
    """Block b's kernel is filled with b, the embedding with -1."""
    blocks = {f"b{b}": {"kernel": jnp.full((WIDTH, WIDTH), b, jnp.float32)} for b in range(BLOCKS)}
    return {"embed": jnp.full((WIDTH,), -1.0), **blocks}


def test_stage_s_holds_chunks_s_s_plus_p_and_nothing_else(mesh):
    form = StageForm(tuple(f"b{b}" for b in range(BLOCKS)), STAGES, VIRTUAL, "stage")
    pspecs = form.staged_pspecs({"embed": P(), **{name: {"kernel": P(None, "data")}
                                                 for name in form.blocks}})
    shardings = jax.tree.map(lambda ps: NamedSharding(mesh, ps), pspecs,
                             is_leaf=lambda x: isinstance(x, P))
    staged = jax.jit(form.staged, out_shardings=shardings)(params_of_blocks())
    per_chunk = BLOCKS // (STAGES * VIRTUAL)
    stage_of = {d: s for s, row in enumerate(mesh.devices) for d in row}
    for shard in staged.stages["kernel"].addressable_shards:
        s = stage_of[shard.device]
        # its [1, virtual, per_chunk] blocks: chunk c·p + s, each chunk's blocks in order
        held = np.asarray(shard.data)[0, :, :, 0, 0]
        want = [[(c * STAGES + s) * per_chunk + j for j in range(per_chunk)]
                for c in range(VIRTUAL)]
        np.testing.assert_array_equal(held, want)
        assert shard.data.shape == (1, VIRTUAL, per_chunk, WIDTH, WIDTH // 4)

    # saved as the model's own tree, each block split over the stages on a free dimension,
    # and restored into the stage form unchanged
    stored = whole_abstract(staged)
    assert stored["b3"]["kernel"].sharding.spec == P("stage", "data")
    whole = whole_arrays(staged)
    assert jax.tree.map(lambda x: x.sharding.spec, whole) == jax.tree.map(
        lambda x: x.sharding.spec, stored)
    original = params_of_blocks()
    assert jax.tree.structure(whole) == jax.tree.structure(original)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(original)):
        np.testing.assert_array_equal(a, b)
    again = staged_like(whole, staged)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(staged)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def compiled_step():
    """The tiny model's step compiled on pipeline 2 x data 4 (nothing runs)."""
    spec = tiny_spec("model.n_layers=4", 'mesh.axes={stage={role="pipeline",size=2},data={size=4}}')
    step, abstract = build_abstract_job(spec)
    batch = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed).batch(0)
    return step, abstract, step.compile(abstract, batch)


def test_each_stage_holds_half_the_blocks_state(compiled_step):
    step, abstract, _ = compiled_step
    blocks = [x for path, x in jax.tree_util.tree_leaves_with_path(abstract)
              if "stages" in jax.tree_util.keystr(path)]
    assert blocks  # parameters, and AdamW's two moments
    for x in blocks:
        assert x.sharding.shard_shape(x.shape)[0] == 1 and x.shape[0] == STAGES


def collectives_over_stage(compiled, mesh) -> list[tuple[str, float]]:
    """(kind, bytes per execution) of every collective in the program whose groups span the
    stage axis, wherever it is (the tick loop's branches included)."""
    out = []
    for line in compiled.as_text().splitlines():
        found = re.search(r"\s(all-reduce|all-gather|all-to-all|reduce-scatter|"
                          r"collective-permute)(?:-start)?\(", line)
        if not found:
            continue
        # a permute's pairs over 2 stages are the stage axis's groups
        if "stage" in axes_of_groups(parse_replica_groups(line, mesh.size), dict(mesh.shape)):
            shape = line.split("=", 1)[1].split(found.group(1))[0]
            out.append((found.group(1), shape_bytes(shape)))
    return out


def test_no_block_gradient_crosses_the_pipeline_axis(compiled_step):
    step, abstract, compiled = compiled_step
    over_stages = collectives_over_stage(compiled, step.mesh)
    assert {kind for kind, _ in over_stages} == {"collective-permute", "all-reduce"}, over_stages
    # the permutes carry one pipeline micro-batch's activations (2 rows of 16 x 32, float32);
    # the all-reduces, what every stage shares: the gradients of the embedding, final norm and
    # head, the embedding output's cotangent and the loss; less than one stage's blocks
    assert {b for kind, b in over_stages if kind == "collective-permute"} == {2 * 16 * 32 * 4}
    block_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.params.stages))
    rest_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.params.rest))
    summed = sum(b for kind, b in over_stages if kind == "all-reduce")
    assert rest_bytes <= summed < rest_bytes + block_bytes / STAGES, (
        over_stages, rest_bytes, block_bytes)


def test_each_replica_sums_its_block_gradients_once_a_step(compiled_step):
    # over the data axis: one all-reduce of a stage's block gradients after the schedule (not
    # one per backward tick), and the embedding's, whose gradient is made outside the pipeline
    step, abstract, compiled = compiled_step
    over_data = analyze_compiled(compiled, step.mesh).by_kind_and_axis()["all-reduce"]["data"]
    block_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.params.stages))
    embedding = abstract.params.rest["embedding"]
    assert over_data == block_bytes / STAGES + embedding.size * embedding.dtype.itemsize
