"""Bazel builds the xla_ext module offline (BUILD, WORKSPACE, bazel/) and the module works.

The build takes its headers from this interpreter's environment ($TRAINSPEC_PYTHON). A child
process then loads the Bazel-built .so on its own (not the pip-built trainspec.jax._xla_ext),
registers its handlers with jax and runs the fingerprint: its targets must be the pip-built
module's, its FFI API and jaxlib this environment's, its output the NumPy reference.

Skipped on a machine without bazel, except under CI (CI=true), where that fails: .ci/run installs
Debian's bazel-bootstrap for this test.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jaxlib.version
import numpy as np
import pytest

from trainspec.jax import xla_ext
from trainspec.jax.fingerprint import fingerprint_reference

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

_LOAD_AND_RUN = textwrap.dedent("""
    import importlib.util, json, sys
    import jax, jax.numpy as jnp, numpy as np
    spec = importlib.util.spec_from_file_location("_xla_ext", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    call = jax.ffi.ffi_call("trainspec_fingerprint", jax.ShapeDtypeStruct((2,), jnp.uint32))
    x = np.arange(1001, dtype=np.float32)
    print(json.dumps({
        "targets": sorted(module.registrations()),
        "build_info": module.build_info(),
        "fingerprint": np.asarray(jax.jit(call)(x)).tolist(),
    }))
""")


@pytest.fixture(scope="module")
def bazel_module(tmp_path_factory):
    bazel = shutil.which("bazel")
    if bazel is None:
        if os.environ.get("CI") == "true":
            pytest.fail("bazel is not installed under CI (.ci/run installs bazel-bootstrap)")
        # Bazel is a system package (no wheel on the index), so `pip install .[test]` cannot
        # provide it: where it is absent the build cannot be tried at all.
        pytest.skip("needs `bazel` on PATH, which pip cannot install: apt-get install "
                    "bazel-bootstrap (.ci/run does, and fails this test without it)")
    out = tmp_path_factory.mktemp("bazel")
    build = subprocess.run(
        # --batch: no Bazel server is left running after the test.
        [bazel, "--batch", "build", f"--symlink_prefix={out}/bazel-", "//:trainspec"],
        cwd=ROOT, env={**os.environ, "TRAINSPEC_PYTHON": sys.executable},
        capture_output=True, text=True, timeout=1500)
    assert build.returncode == 0, build.stderr[-4000:]
    so = out / "bazel-bin" / "trainspec" / "jax" / "_xla_ext.so"
    run = subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, str(so)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_bazel_module_registers_the_handlers_of_the_pip_build(bazel_module):
    assert bazel_module["targets"] == sorted(xla_ext.TARGETS)


def test_bazel_module_is_built_against_this_environment(bazel_module):
    assert tuple(bazel_module["build_info"]["xla_ffi_api"]) == xla_ext.running_ffi_api()
    assert bazel_module["build_info"]["jaxlib"] == jaxlib.version.__version__


def test_bazel_module_computes_the_fingerprint(bazel_module):
    expected = fingerprint_reference(np.arange(1001, dtype=np.float32))
    assert bazel_module["fingerprint"] == expected.tolist()


def test_bazel_compiles_the_sources_cmake_compiles():
    """BUILD mirrors xla_ext's CMake files (checked without bazel, so drift shows everywhere)."""
    xla_ext_dir = ROOT / "xla_ext"
    cmake = "".join(p.read_text() for p in [xla_ext_dir / "CMakeLists.txt",
                                            *sorted(xla_ext_dir.glob("*.cmake"))])
    source_lists = re.findall(r"set\(\w+_SOURCES(.*?)\)", cmake, re.S)
    in_cmake = {name for block in source_lists for name in re.findall(r"(\w+\.cc)", block)}
    in_bazel = set(re.findall(r'"xla_ext/(\w+\.cc)"', (ROOT / "BUILD").read_text()))
    assert in_cmake and in_bazel == in_cmake
