"""Spec loading, validation messages, overrides, and the committed JSON Schema / docs."""
import json
import re
from pathlib import Path

import jsonschema
import pytest

from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec, default_spec, json_schema, load_spec, schema_text

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_resolve():
    spec = load_spec({})
    assert spec.spec_version == 1
    assert spec.batch.micro == spec.batch.global_batch and spec.batch.accumulation_steps == 1
    assert spec.mesh.axes_with_role("data") == ("data",)


def test_default_spec_file_agrees_with_the_schema_defaults():
    # micro_batch defaults to global_batch in both (docs/spec.md), so the shipped default spec
    # wraps an opaque step (one that cannot be accumulated) as it is.
    spec = default_spec()
    assert spec.batch.micro == spec.batch.global_batch and spec.batch.accumulation_steps == 1


def test_toml_text_dict_and_path_agree(tmp_path):
    text = "[batch]\nglobal_batch = 8\nmicro_batch = 4\n"
    path = tmp_path / "s.toml"
    path.write_text(text)
    assert load_spec(text) == load_spec(path) == load_spec(str(path)) == load_spec(
        {"batch": {"global_batch": 8, "micro_batch": 4}}
    )


def test_overrides_apply_typed_values():
    spec = load_spec(None, ["mesh.axes.fsdp.size=2", "optimizer.learning_rate=0.5",
                            "collectives.backend=ext", "checkpoint.async_save=false"])
    assert spec.mesh.axes["fsdp"].size == 2
    assert spec.optimizer.learning_rate == 0.5
    assert spec.collectives.backend == "ext"  # not valid TOML: taken as a string
    assert spec.checkpoint.async_save is False


def test_custom_axis_name_needs_role():
    spec = load_spec({"mesh": {"axes": {"replica": {"role": "data", "size": 2, "dcn": 2},
                                        "data": {"size": -1}}}})
    assert spec.mesh.axes_with_role("data") == ("replica", "data")


BAD = {
    "unknown top-level field": ({"bogus": 1}, r"field 'bogus': unknown field"),
    "unknown nested field": ({"batch": {"globl_batch": 8}}, r"field 'batch\.globl_batch'"),
    "wrong type": ({"batch": {"global_batch": "many"}}, r"field 'batch\.global_batch'.*'many'"),
    "wrong version": ({"spec_version": 2}, r"field 'spec_version'.*2"),
    "two inferred axes": (
        {"mesh": {"axes": {"data": {"size": -1}, "fsdp": {"size": -1}}}}, r"at most one axis"
    ),
    "zero size": ({"mesh": {"axes": {"data": {"size": 0}}}}, r"mesh\.axes\.data.*size"),
    "size not multiple of dcn": ({"mesh": {"axes": {"data": {"size": 3, "dcn": 2}}}}, r"dcn"),
    "axis without role": ({"mesh": {"axes": {"rows": {"size": 2}}}}, r"axis 'rows' needs a role"),
    "inconsistent batch": (
        {"batch": {"global_batch": 10, "micro_batch": 4}}, r"global_batch 10 .* micro_batch 4"
    ),
    "rule names missing axis": ({"layout": {"rules": {"embed": ["model"]}}}, r"layout\.rules\.embed"),
    "bad dtype": ({"precision": {"compute": "float8"}}, r"field 'precision\.compute'"),
    "bad backend": ({"collectives": {"backend": "mpi"}}, r"field 'collectives\.backend'"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_naming_the_field(case):
    data, pattern = BAD[case]
    with pytest.raises(UserInputError) as err:
        load_spec(data)
    message = str(err.value)
    assert "\n" not in message
    assert re.search(pattern, message), message


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(UserInputError, match="not found"):
        load_spec(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[batch\n")
    with pytest.raises(UserInputError, match="not valid TOML"):
        load_spec(bad)
    with pytest.raises(UserInputError, match="--set expects"):
        load_spec(None, ["no_equals_sign"])


def test_committed_schema_matches_definition():
    committed = (ROOT / "docs" / "spec.schema.json").read_text()
    assert committed == schema_text(), "regenerate: python -m trainspec.core.schema spec > docs/spec.schema.json"


def test_schema_accepts_default_and_rejects_unknown():
    schema = json_schema()
    jsonschema.validate(default_spec().to_dict(), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"bogus": 1}, schema)


def _field_paths(model, prefix=""):
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        yield path
        annotation = field.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            yield from _field_paths(annotation, path + ".")


def test_every_field_is_stated_in_spec_md():
    doc = (ROOT / "docs" / "spec.md").read_text()
    missing = [p for p in _field_paths(Spec) if f"`{p}`" not in doc]
    assert not missing, f"docs/spec.md does not state: {missing}"
    axis_fields = ["role", "size", "dcn"]
    assert all(f"`mesh.axes.<name>.{f}`" in doc for f in axis_fields)


def test_example_specs_are_valid():
    examples = sorted((ROOT / "examples").glob("*.toml"))
    assert {p.stem for p in examples} >= {"data", "fsdp", "tensor", "mixed"}
    for path in examples:
        load_spec(path)
    json.dumps(default_spec().to_dict())
