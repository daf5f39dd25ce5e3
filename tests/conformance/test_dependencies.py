"""What a user installs (pyproject.toml): the torch implementation and the conformance runner
import nothing outside the package's base dependencies and its `torch` extra, with jax made
unimportable; a command that needs a framework that is not installed says in one line which
extra to install."""
import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
JAX_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax")
# The torch path as a torch-only user runs it: the runner end to end (the numpy implementation,
# records validated), then every module of the torch implementation and its CLI. A finder
# notes each top-level module that trainspec's own code imports (what its dependencies import
# in turn, optional ones included, is theirs to declare).
TORCH_PATH = """
import importlib.abc, json, sys
wanted = set()
class Note(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        frame = sys._getframe(1)
        while frame and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen")):
            frame = frame.f_back
        if frame and frame.f_globals.get("__name__", "").startswith("trainspec"):
            wanted.add(name.split(".")[0])
sys.meta_path.insert(0, Note())
from trainspec.cli.main import main
assert main(["conformance", "--impl", "numpy_impl:NumpyAdapter", "--quick"]) == 0
import trainspec.torch.backend, trainspec.torch.runtime, trainspec.torch.train
import trainspec.torch.checkpoint, trainspec.torch.collectives
print(json.dumps(sorted(wanted - set(sys.stdlib_module_names))))
"""


def _without_jax(tmp_path) -> dict:
    for name in JAX_PACKAGES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(HERE)])}


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")


def _closure(names: set[str]) -> set[str]:
    """The distributions `names` install: themselves and what they require, recursively."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or ()
        except metadata.PackageNotFoundError:  # not installed here (a marker excludes it)
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def test_the_torch_path_needs_the_base_dependencies_and_the_torch_extra(tmp_path):
    pytest.importorskip("torch", reason="the torch path needs the torch extra (CI's newest-jax leg has none)")
    done = subprocess.run([sys.executable, "-c", TORCH_PATH], capture_output=True, text=True,
                          env=_without_jax(tmp_path), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    modules = set(json.loads(done.stdout.strip().splitlines()[-1]))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_extra = project["optional-dependencies"]["torch"]
    declared = {_name(r) for r in [*project["dependencies"], *torch_extra]}
    installs = _closure(declared)
    owners = metadata.packages_distributions()
    third_party = modules - {"trainspec", "numpy_impl"}
    assert {"torch", "jsonschema", "numpy"} <= third_party  # the finder sees trainspec's imports
    missing = {m: owners.get(m) for m in third_party
               if not any(_name(d) in installs for d in owners.get(m, ()))}
    assert not missing, f"imported, but not installed by the base dependencies + torch: {missing}"
    assert not modules & set(JAX_PACKAGES)


def test_a_missing_framework_is_one_line_naming_the_extra(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trainspec.cli.main", "train", "--steps", "1",
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                          env=_without_jax(tmp_path), timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "trainspec: error: this command needs jax, which is not installed: "
        "pip install 'trainspec[jax]'"]
