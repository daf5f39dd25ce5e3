"""The `[pipeline]` section and the pipeline mesh role: what validates, and the one line that
names the field of what does not (docs/spec.md, `pipeline`)."""
from __future__ import annotations

import pytest

from trainspec.core.errors import UserInputError
from trainspec.core.mesh import check_batch, pipeline_microbatches, resolve_mesh
from trainspec.core.pipeline.stages import chunk_layers, stage_of_chunk
from trainspec.core.spec import load_spec

PIPE = 'mesh.axes = {data = {size = -1}, stage = {role = "pipeline", size = %d}}\n'


def spec(stages: int, extra: str = "", **model):
    text = PIPE % stages + "[model]\n" + "".join(f"{k} = {v}\n" for k, v in model.items())
    return load_spec(text + extra)


def refused(text: str) -> str:
    with pytest.raises(UserInputError) as err:
        load_spec(text)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_an_even_split_by_default_and_a_pipeline_axis_of_its_own_role():
    s = spec(2, n_layers=4)
    dims = resolve_mesh(s, 8)
    assert dims.shape == {"data": 4, "stage": 2} and dims.stages == 2
    assert pipeline_microbatches(s, dims) == 2  # default: one per stage
    assert chunk_layers(4, 2) == [range(0, 2), range(2, 4)]


def test_an_explicit_list_and_the_looped_placement_of_interleaved_chunks():
    s = spec(2, '[pipeline]\nschedule = "interleaved_1f1b"\nvirtual_stages = 2\n'
             "microbatches = 4\nlayers_per_stage = [1, 2, 2, 1]\n", n_layers=6)
    assert [len(r) for r in chunk_layers(6, 4, s.pipeline.layers_per_stage)] == [1, 2, 2, 1]
    assert [stage_of_chunk(k, 2) for k in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("extra, model, field, words", [
    ("", {"n_layers": 3}, "model.n_layers", "3 layers do not split evenly over 2"),
    ("[pipeline]\nlayers_per_stage = [1, 1, 1]\n", {"n_layers": 3},
     "pipeline.layers_per_stage", "lists 3 stages, but the mesh has 2"),
    ("[pipeline]\nlayers_per_stage = [1, 1]\n", {"n_layers": 3},
     "pipeline.layers_per_stage", "sums to 2 layers, but model.n_layers is 3"),
    ("[pipeline]\nlayers_per_stage = [0, 2]\n", {"n_layers": 2},
     "pipeline.layers_per_stage", "at least one layer"),
    ('[pipeline]\nschedule = "interleaved_1f1b"\n', {"n_layers": 4},
     "pipeline.virtual_stages", "at least 2 virtual stages"),
    ("[pipeline]\nvirtual_stages = 2\n", {"n_layers": 4},
     "pipeline.virtual_stages", "needs schedule = \"interleaved_1f1b\""),
    ('[pipeline]\nschedule = "interleaved_1f1b"\nvirtual_stages = 2\nmicrobatches = 3\n',
     {"n_layers": 4}, "pipeline.microbatches", "3 is not a multiple of the 2 pipeline stages"),
    ('[pipeline]\nschedule = "pipedream"\n', {}, "pipeline.schedule", "'pipedream'"),
])
def test_each_bad_section_is_one_line_naming_its_field(extra, model, field, words):
    text = PIPE % 2 + "[model]\n" + "".join(f"{k} = {v}\n" for k, v in model.items()) + extra
    message = refused(text)
    assert f"'{field}'" in message and words in message


def test_two_pipeline_axes_are_refused():
    message = refused('mesh.axes = {a = {role = "pipeline", size = 2}, '
                      'b = {role = "pipeline", size = 2}}\n')
    assert "at most one axis may have role pipeline" in message


def test_an_inferred_pipeline_axis_is_checked_when_the_mesh_is_resolved():
    s = load_spec('mesh.axes = {data = {size = 2}, stage = {role = "pipeline", size = -1}}\n'
                  "[model]\nn_layers = 2\n")
    assert resolve_mesh(s, 4).stages == 2
    with pytest.raises(UserInputError, match=r"^model.n_layers: 2 layers do not split evenly "
                       r"over 4 .*\(mesh data=2 x stage=4\)$"):
        resolve_mesh(s, 8)


def test_the_batch_shard_must_divide_into_the_pipeline_micro_batches():
    s = spec(2, "[pipeline]\nmicrobatches = 3\n[batch]\nglobal_batch = 8\n", n_layers=2)
    dims = resolve_mesh(s, 8)  # data 4: 2 sequences per shard, not 3 micro-batches
    with pytest.raises(UserInputError, match="^batch.micro_batch: the 2 sequences of each of "
                       "the 4 batch shards do not split into pipeline.microbatches = 3$"):
        check_batch(s, dims, ("data",))
    check_batch(spec(2, "[batch]\nglobal_batch = 8\n", n_layers=2), dims, ("data",))


def test_no_pipeline_axis_leaves_the_section_without_effect():
    s = load_spec("[pipeline]\nmicrobatches = 3\n")
    dims = resolve_mesh(s, 8)
    assert dims.stages == 1 and pipeline_microbatches(s, dims) == 1
    check_batch(s, dims, ("data",))
