"""The CUDA side of xla_ext as far as a machine without a GPU can check it: the CUDA module, where
the install built it, carries a handler for every CPU target (same names, registered for
platform "CUDA"); a request that needs a GPU is refused in one line; NCCL's groups follow lax's
rank order; a missing NCCL library is one line. The kernels' arithmetic is the CPU kernels'
(shared TS_HD element functions), which the CPU suites check against NumPy; the CUDA sources
compile in tests/jax/test_cuda_compile.py."""
import os
import shutil

import jax
import numpy as np
import pytest
from jax import lax

from trainspec.core.errors import UserInputError
from trainspec.jax import xla_ext
from trainspec.jax.collectives import nccl


@pytest.fixture(scope="module")
def cuda_module():
    module = xla_ext.cuda_module()
    if module is None:
        if os.environ.get("CI") == "true" and shutil.which("nvcc"):
            pytest.fail("nvcc is on PATH but the install built no CUDA module (TRAINSPEC_CUDA)")
        pytest.skip("this install was built without the CUDA module (no nvcc at install time)")
    return module


def test_the_cuda_module_has_a_handler_for_every_cpu_target(cuda_module):
    assert set(cuda_module.registrations()) == set(xla_ext.TARGETS)


def test_the_cuda_module_passes_the_ffi_version_check(cuda_module):
    xla_ext._check_version(cuda_module)
    assert cuda_module.build_info()["cuda_runtime"] >= 13000


def test_cuda_handlers_are_registered_only_where_jax_may_have_a_gpu():
    assert xla_ext.CUDA_TARGETS == (xla_ext.register_cuda_handlers()
                                    if xla_ext._cuda_plugin_installed() else frozenset())


def test_a_gpu_request_on_cpu_is_one_line():
    with pytest.raises(UserInputError, match=r'^collectives.backend = "ext": trainspec_all_reduce '
                       r"on a GPU needs a GPU; this process has none \(jax platforms: cpu\)$"):
        xla_ext.require_cuda("trainspec_all_reduce")


def test_a_missing_nccl_library_is_one_line(cuda_module, tmp_path):
    missing = tmp_path / "libnccl.so.2"
    with pytest.raises(RuntimeError, match=rf"^cannot load NCCL from {missing}: [^\n]+$"):
        cuda_module.nccl_load(str(missing))


def test_nccl_is_found_in_its_wheel_or_left_to_the_loader(monkeypatch):
    def no_wheel(name):
        raise nccl.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(nccl.importlib.metadata, "distribution", no_wheel)
    assert nccl.library_path() == "libnccl.so.2"


@pytest.mark.parametrize("axes", [("data",), ("model",), ("data", "model"), ("model", "data")])
def test_nccl_groups_rank_members_as_lax_axis_index_does(axes):
    """Each group lists its devices in the order of lax.axis_index(axes) on them."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    members = nccl.groups(mesh.devices, axes, mesh.axis_names)
    index = jax.jit(jax.shard_map(lambda: lax.axis_index(axes)[None], mesh=mesh, in_specs=(),
                                  out_specs=jax.P(("data", "model"))))()
    rank_of = dict(zip((d.id for d in mesh.devices.flat), np.asarray(index)))
    n = int(np.prod([mesh.shape[a] for a in axes]))
    assert len(members) == 8 // n
    assert all([rank_of[d.id] for d in group] == list(range(n)) for group in members)
    assert sorted(d.id for group in members for d in group) == list(range(8))
