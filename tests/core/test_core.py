"""trainspec.core is framework-free, and its plain-integer mesh placement is the one JAX uses."""
import pkgutil
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils

import trainspec.core
from trainspec.jax import build_mesh
from trainspec.core.errors import UserInputError
from trainspec.core.mesh import place_devices, resolve_mesh
from trainspec.core.spec import load_spec

CORE_MODULES = sorted(f"trainspec.core.{m.name}" for m in pkgutil.iter_modules(trainspec.core.__path__))
FORBIDDEN = ("jax", "jaxlib", "torch", "flax", "optax", "orbax")

# Run in a fresh interpreter: a meta-path finder refuses every framework, so an import of one
# anywhere below trainspec.core (directly or through a dependency) fails the import.
BLOCKED_IMPORT = f"""
import importlib, sys
FORBIDDEN = {FORBIDDEN!r}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError(f"framework import refused: {{name}}")
sys.meta_path.insert(0, Refuse())
for name in sys.argv[1:]:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
assert not loaded, loaded
print("imported", len(sys.argv) - 1, "modules")
"""


def test_core_modules_import_without_any_framework():
    assert "trainspec.core.spec" in CORE_MODULES and len(CORE_MODULES) >= 8
    modules = ["trainspec", "trainspec.jax", "trainspec.core", *CORE_MODULES, "trainspec.core.transformer_flops"]
    done = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT, *modules],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"imported {len(modules)} modules" in done.stdout


def test_the_blocker_catches_a_framework_import():
    """The check above can fail: a module that imports jax is refused."""
    done = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT, "trainspec.jax.mesh"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "framework import refused: jax" in done.stderr


def _spec(axes: dict, exclude=()):
    return load_spec({"mesh": {"axes": axes, "exclude_devices": list(exclude)},
                      "batch": {"global_batch": 8}})


def test_groups_per_axis_in_plain_integers():
    placed = place_devices(_spec({"data": {"size": 2}, "tensor": {"size": -1}}), range(8))
    assert placed.dims.sizes == (2, 4)
    assert placed.groups("tensor") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert placed.groups("data") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert placed.groups(("tensor", "data")) == [(0, 4, 1, 5, 2, 6, 3, 7)]  # ranked in the order given


def test_parallel_dims_resolve_the_spec_once():
    """Roles come from the role field or the axis's name; degrees multiply every axis of a
    role, `split` keeps those of more than one device, and -1 takes what is left."""
    spec = _spec({"replica": {"role": "data", "size": 2, "dcn": 2}, "data": {"size": -1},
                  "fsdp": {"size": 1}, "tensor": {"size": 2}})
    dims = resolve_mesh(spec, 16)
    assert dims.shape == {"replica": 2, "data": 4, "fsdp": 1, "tensor": 2}
    assert dims.roles == ("data", "data", "fsdp", "tensor")
    assert (dims.world_size, dims.replicas, dims.fsdp, dims.tensor) == (16, 8, 1, 2)
    assert dims.axes_with_role("fsdp") == ("fsdp",) and dims.split("fsdp") == ()
    assert dims.split("data") == ("replica", "data")
    assert dims.split_beside("data") == ("tensor",)
    assert dims.group(("replica", "data")) == (8, 2) and dims.ici == (1, 4, 1, 2)
    assert dims.describe() == "replica=2 x data=4 x fsdp=1 x tensor=2"
    with pytest.raises(UserInputError, match="cannot infer 'data': 10 devices"):
        resolve_mesh(spec, 10)


def test_exclusion_and_its_errors():
    placed = place_devices(_spec({"data": {"size": -1}}, exclude=[1, 6]), range(8))
    assert placed.groups("data") == [(0, 2, 3, 4, 5, 7)]
    with pytest.raises(UserInputError, match="mesh.exclude_devices names device ids \\[9\\]"):
        place_devices(_spec({"data": {"size": -1}}, exclude=[9]), range(8))
    with pytest.raises(UserInputError, match="needs 8 devices, but 6"):
        place_devices(_spec({"data": {"size": 8}}, exclude=[0, 1]), range(8))


def _fake_devices(n_processes, per_process):
    return [SimpleNamespace(id=p * per_process + i, process_index=p, platform="cpu",
                            device_kind="cpu") for p in range(n_processes) for i in range(per_process)]


@pytest.mark.parametrize("axes", [
    {"replica": {"role": "data", "size": 2, "dcn": 2}, "data": {"size": 4}},
    {"data": {"size": 4, "dcn": 2}, "tensor": {"size": 2}},
    {"data": {"size": 2}, "fsdp": {"size": 4, "dcn": 2}},
])
def test_hybrid_layout_matches_jax_mesh_utils(axes):
    """Across processes the core lays processes out as blocks, as jax's hybrid mesh does."""
    spec = _spec(axes)
    devices = _fake_devices(2, 4)
    placed = place_devices(spec, [d.id for d in devices], [d.process_index for d in devices])
    r = placed.dims
    grid = mesh_utils.create_hybrid_device_mesh(r.ici, r.dcn, devices, process_is_granule=True)
    np.testing.assert_array_equal(placed.ids, np.vectorize(lambda d: d.id)(grid))
    np.testing.assert_array_equal(placed.processes, np.vectorize(lambda d: d.process_index)(grid))


def test_jax_mesh_is_the_core_placement():
    spec = _spec({"data": {"size": 2}, "fsdp": {"size": -1}}, exclude=[3, 5])
    spec = load_spec(spec, ["mesh.axes.fsdp.size=3"])
    mesh = build_mesh(spec)
    placed = place_devices(spec, [d.id for d in jax.devices()])
    np.testing.assert_array_equal(np.vectorize(lambda d: d.id)(mesh.devices), placed.ids)
