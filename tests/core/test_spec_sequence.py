"""The spec's context and expert roles and [model.moe]: what validates, and the one line
naming the field for what does not, at load time (fixed sizes) and at mesh resolution (an
inferred axis)."""
import pytest

from trainspec.core.errors import UserInputError
from trainspec.core.mesh import resolve_mesh
from trainspec.core.spec import load_spec


def _spec(axes, **sections):
    return {"mesh": {"axes": axes}, **sections}


def test_context_and_expert_axes_resolve_with_their_roles():
    spec = load_spec(_spec({"data": {"size": -1}, "seq": {"role": "context", "size": 2},
                            "expert": {"size": 2}},
                           model={"moe": {"experts": 4, "top_k": 2}}, batch={"seq_len": 64}))
    dims = resolve_mesh(spec, 8)
    assert dims.shape == {"data": 2, "seq": 2, "expert": 2}
    assert dims.split("context") == ("seq",) and dims.degree("expert") == 2
    assert spec.context.attention == "ring" and spec.context.split == "zigzag"
    assert spec.model.moe.capacity_factor == 0  # dropless by default


BAD = {
    "zigzag needs 2n chunks": (
        _spec({"data": {"size": -1}, "context": {"size": 4}}, batch={"seq_len": 36}),
        "field 'batch.seq_len': 36 tokens do not split into the 8 equal chunks a zigzag split "
        "over context axes context (size 4) needs"),
    "experts over the expert axis": (
        _spec({"data": {"size": -1}, "expert": {"size": 4}}, model={"moe": {"experts": 6}}),
        "field 'model.moe.experts': 6 experts do not split evenly over expert axes expert "
        "(size 4)"),
    "expert axis without experts": (
        _spec({"data": {"size": -1}, "ep": {"role": "expert", "size": 2}}),
        "field 'mesh.axes.ep': an expert axis of size 2 shards experts, but the model has "
        "none: add [model.moe]"),
    "top_k above experts": ({"model": {"moe": {"experts": 2, "top_k": 3}}},
                            "field 'model.moe': top_k 3 exceeds experts 2"),
    "negative capacity": ({"model": {"moe": {"experts": 2, "capacity_factor": -1.0}}},
                          "field 'model.moe.capacity_factor'"),
    "unknown attention": ({"context": {"attention": "flash"}}, "field 'context.attention'"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_specs_fail_in_one_line_naming_the_field(name):
    data, expected = BAD[name]
    with pytest.raises(UserInputError) as err:
        load_spec(data)
    line = str(err.value)
    assert expected in line and "\n" not in line, line


def test_contiguous_split_needs_only_n_chunks():
    spec = load_spec(_spec({"data": {"size": -1}, "context": {"size": 4}},
                           batch={"seq_len": 36}, context={"split": "contiguous"}))
    assert resolve_mesh(spec, 8).shape["context"] == 4


def test_an_inferred_context_axis_is_checked_at_resolution():
    spec = load_spec(_spec({"data": {"size": 2}, "context": {"size": -1}}, batch={"seq_len": 12}))
    resolve_mesh(spec, 6)  # 3 ranks: 6 chunks of 2
    with pytest.raises(UserInputError, match="^batch.seq_len: 12 tokens do not split into the "
                                             "8 equal chunks"):
        resolve_mesh(spec, 8)
