"""The backends are found by name through the `trainspec.backends` entry points
(trainspec.core.registry), the conformance suite's targets through the same registry, and
nothing is imported to list them: no framework, no backend's modules beyond its registration."""
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trainspec.core import registry
from trainspec.core.backend import Backend
from trainspec.core.errors import UserInputError

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_registers_its_backends_in_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared[registry.BACKENDS] == {"jax": "trainspec.jax.backend:BACKEND",
                                           "torch": "trainspec.torch.backend:BACKEND"}
    assert registry.backend_names()[:2] == ["jax", "torch"]
    for name in ("jax", "torch"):
        found = registry.backend(name)
        assert isinstance(found, Backend) and found.name == name
        assert found.capabilities.implementation == name


def test_conformance_targets_come_from_the_backends():
    assert registry.conformance_targets() == {
        "xla": "jax", "ext": "jax", "hierarchical": "jax", "torch": "torch"}


def test_an_unknown_backend_is_one_line_naming_the_known_ones():
    with pytest.raises(UserInputError, match=r"^--framework mxnet: not a backend; one of jax, torch"):
        registry.backend("mxnet")


def test_listing_the_backends_imports_no_framework():
    code = ("import sys; from trainspec.core import registry; "
            "names = registry.backend_names(); targets = registry.conformance_targets(); "
            "loaded = [m for m in ('jax', 'torch', 'flax', 'optax') if m in sys.modules]; "
            "assert not loaded, loaded; print(names, sorted(targets))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "['jax', 'torch']" in done.stdout


def test_a_package_registers_another_backend(tmp_path):
    """An installed package's `trainspec.backends` entry point (a .dist-info directory on
    PYTHONPATH, as pip leaves one) adds a backend beside the package's own."""
    dist = tmp_path / "other_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: other-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[trainspec.backends]\nother = other_backend:BACKEND\n")
    (tmp_path / "other_backend.py").write_text(
        "from trainspec.torch.backend import TorchBackend\n"
        "class Other(TorchBackend):\n    name = 'other'\n    conformance_targets = ()\n"
        "BACKEND = Other()\n")
    code = ("from trainspec.core import registry; "
            "print(registry.backend_names(), registry.backend('other').name)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(tmp_path), "PATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['jax', 'torch', 'other'] other"
