"""A seeded fuzz of spec and CLI inputs: every mutation of the default spec that no run can
take (a wrong type, a value past a documented bound, a unicode or unknown key, a malformed
--set or flag) is one line on stderr, exit 2, no traceback, nothing written.

`trainspec validate` runs in-process through the CLI's main() (each case is refused before any
framework is imported), a few `trainspec train` cases as subprocesses. Unicode digits are
numbers to Python's int() ("２" is 2): not counted as bad here."""
import random
import subprocess
import sys
from pathlib import Path

import pytest

from trainspec.cli.main import main
from trainspec.core.spec import json_schema

from xla_env import without_device_count

SEED = 46
CASES = 300
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "trainspec/default.toml"
WRONG_TYPE = {
    "integer": ['"text"', "true", "1.5", "[1]", "{a = 1}"],
    "number": ['"text"', "false", "[1.0]", "nan", "inf", "-inf"],
    "string": ["1", "true", "[1]", "{a = 1}"],
    "boolean": ["1", '"yes"', "[true]"],
    "array": ['"a"', "1", '["a"]', "[1.5]"],
}
UNICODE = ["データ", "é", "ß", "\u200b", "😀", "a\u0301", "Ω", "x y"]
BAD_SETS = ["noequals", "=3", "batch.=1", ".=1", "batch..global_batch=3", "batch.global_batch=",
            "batch.global_batch=[", "model=1", "mesh.axes=3", 'layout.rules.batch=["nope"]',
            "spec_version=2", "seed=-1", f"seed={2**70}"]
BAD_HOST_DEVICES = ["0", "-3", "100000", "x", "1e3", "", "1.5"]


def _leaves(schema):
    """(dotted path, JSON Schema) of every scalar or list field the spec's schema defines,
    optional sections included."""
    defs = schema["$defs"]

    def resolve(node):
        if "$ref" in node:
            return defs[node["$ref"].rsplit("/", 1)[-1]]
        for option in node.get("anyOf", ()):  # `section | None`: the section
            if "$ref" in option:
                return defs[option["$ref"].rsplit("/", 1)[-1]]
        return node

    def walk(node, path):
        node = resolve(node)
        if "properties" in node:
            for name, child in node["properties"].items():
                yield from walk(child, [*path, name])
        elif node.get("type") != "object":  # tables keyed by the user (axes, rules): below
            yield ".".join(path), node

    yield from walk(schema, [])


def _types(field):
    types = field.get("type") or [o.get("type") for o in field.get("anyOf", ()) if o.get("type")]
    return [types] if isinstance(types, str) else [t for t in types if t != "null"]


def _out_of_bounds(field):
    values = []
    for option in [field, *field.get("anyOf", ())]:
        if "maximum" in option:
            top = option["maximum"]
            values += [str(top + 1) if isinstance(top, int) else repr(top * 10.0), str(2**70)]
        if "minimum" in option and option["minimum"] > -1:
            low = option["minimum"]
            values.append(str(low - 1) if isinstance(low, int) else repr(low - 1.0))
        if "exclusiveMinimum" in option:
            values.append(repr(option["exclusiveMinimum"]))
        if "enum" in option or "const" in option:
            values += ['"bogus"', '"データ"']
    return values


def candidates():
    """Every mutation: (label, argv after `validate DEFAULT`)."""
    found = []
    for path, field in _leaves(json_schema()):
        for kind in _types(field):
            found += [(f"{path}={v}", ["--set", f"{path}={v}"]) for v in WRONG_TYPE.get(kind, ())]
        found += [(f"{path}={v}", ["--set", f"{path}={v}"]) for v in _out_of_bounds(field)]
    sections = {path.split(".")[0] for path, _ in _leaves(json_schema()) if "." in path}
    for section in sorted(sections):
        found += [(f"{section}.{u}", ["--set", f'{section}."{u}"=1']) for u in UNICODE]
    found += [(f"axis {u}", ["--set", f'mesh.axes."{u}".size=1', "--set",
                             f'mesh.axes."{u}".role="data"']) for u in UNICODE]
    found += [(f"--set {s}", ["--set", s]) for s in BAD_SETS]
    found += [(f"--host-devices {d}", ["--host-devices", d]) for d in BAD_HOST_DEVICES]
    found += [("--framework bogus", ["--framework", "bogus"]), ("--nprocs on jax", ["--nprocs", "2"])]
    return found


def _sample():
    every = candidates()
    assert len(every) >= CASES, len(every)
    return random.Random(SEED).sample(every, CASES)


def _one_line(code, err):
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainspec: error: "), err


@pytest.mark.parametrize("label,argv", _sample(), ids=[label for label, _ in _sample()])
def test_validate_refuses_every_mutation_in_one_line(label, argv, capsys, tmp_path,
                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)  # where anything written would land
    code = main(["validate", str(DEFAULT_PATH), *argv])
    _one_line(code, capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


TRAIN_CASES = [["--steps", str(2**70)], ["--set", 'mesh.axes."データ".size=1', "--set",
               'mesh.axes."データ".role="data"'], ["--set", "model.n_layers=4096"]]


@pytest.mark.parametrize("argv", TRAIN_CASES, ids=["steps 2**70", "axis データ", "4096 layers"])
def test_train_refuses_in_one_line_and_writes_nothing(argv, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "train", "--run-dir",
         str(tmp_path / "run"), *argv], capture_output=True, text=True,
        env=without_device_count(), cwd=tmp_path, timeout=120)
    _one_line(result.returncode, result.stderr)
    assert [p.name for p in tmp_path.iterdir()] == []


# Every numeric argument the commands take, given in digits of another script (fullwidth,
# Arabic-Indic, Devanagari): (the argument named in the refusal, the command line).
OTHER_DIGITS = [
    ("--steps", ["train", "--steps", "８"]),
    ("--host-devices", ["train", "--host-devices", "٨"]),
    ("--nprocs", ["train", "--framework", "torch", "--nprocs", "२"]),
    ("--exclude-devices", ["train", "--exclude-devices", "1,２"]),
    ("--host-devices", ["validate", str(DEFAULT_PATH), "--host-devices", "８"]),
    ("batch.global_batch", ["validate", str(DEFAULT_PATH), "--set", "batch.global_batch=１６"]),
    ("--nprocs", ["launch", "--nprocs", "２", "--", "true"]),
    ("--grace", ["launch", "--nprocs", "2", "--grace", "１.5", "--", "true"]),
    ("--devices", ["plan", "--devices", "８"]),
    ("--params", ["plan", "--devices", "8", "--params", "１e9"]),
    ("--predict-params", ["scaling", ".", "--predict-params", "１e5", "--predict-tokens", "1e5"]),
    ("--widths", ["sweep", "--out", "grid", "--widths", "１６", "--tokens", "1e3"]),
    ("-b/--min-bytes", ["bench", "collectives", "-b", "４K"]),
]


@pytest.mark.parametrize("argument,argv", OTHER_DIGITS,
                         ids=[f"{argv[0]} {argument}" for argument, argv in OTHER_DIGITS])
def test_digits_of_other_scripts_are_refused_naming_the_argument(argument, argv, capsys,
                                                                 tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    _one_line(code, err)
    assert argument in err, err
    assert list(tmp_path.iterdir()) == []
