"""Every source of the CUDA module (xla_ext/cuda/cuda.cmake) compiles with nvcc for sm_90 + PTX.

No GPU is needed: each source is compiled to an object file (`nvcc -c`), the kernels (.cu) with
the build's flags (--fmad=false, host warnings as errors) and the handlers and module (.cc) as
host C++ through nvcc, which adds the CUDA include paths, against this environment's XLA FFI and
nanobind headers. One nvcc process per source, in parallel.

nvcc comes from PATH or from the nvidia-cuda-nvcc wheel. Without one the test is skipped, except
under CI (CI=true), where that fails: CI's machines have the CUDA toolkit.
"""
import concurrent.futures
import importlib.metadata
import os
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "xla_ext" / "cuda"
# -arch=sm_90 is nvcc's shorthand for -gencode arch=compute_90,code=[sm_90,compute_90]: Hopper
# machine code plus its PTX, what cuda.cmake's "90-real;90-virtual" builds.
ARCH = "sm_90"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    try:  # the nvidia-cuda-nvcc wheel installs nvcc under nvidia/cu13/bin
        wheel = importlib.metadata.distribution("nvidia-cuda-nvcc")
    except importlib.metadata.PackageNotFoundError:
        return None
    candidates = [wheel.locate_file(f) for f in wheel.files or () if str(f).endswith("bin/nvcc")]
    return str(candidates[0]) if candidates else None


@pytest.fixture(scope="module")
def nvcc() -> str:
    found = _nvcc()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no nvcc under CI: the CUDA toolkit (nvcc on PATH) is part of CI's machine")
        pytest.skip("no nvcc on PATH and no nvidia-cuda-nvcc wheel: the CUDA sources are not "
                    "compiled here")
    return found


def _sources() -> list[Path]:
    """The sources cuda.cmake lists, checked against the directory: none is left out."""
    cmake = (CUDA_DIR / "cuda.cmake").read_text()
    listed = re.findall(r"\$\{CMAKE_CURRENT_LIST_DIR\}/([\w./]+\.(?:cu|cc))", cmake)
    sources = [(CUDA_DIR / name).resolve() for name in listed]
    on_disk = set(CUDA_DIR.glob("*.cu")) | set(CUDA_DIR.glob("*.cc"))
    assert on_disk <= set(sources), f"not in cuda.cmake: {sorted(on_disk - set(sources))}"
    return sources


def _nccl_include() -> str | None:
    """The nvidia-nccl wheel's include directory, where it is installed and ships nccl.h."""
    try:
        found = importlib.metadata.distribution("nvidia-nccl-cu13").locate_file(
            "nvidia/nccl/include")
    except importlib.metadata.PackageNotFoundError:
        return None
    return str(found) if (Path(str(found)) / "nccl.h").exists() else None


def _flags(source: Path) -> list[str]:
    import jax
    import nanobind

    includes = ["-I", str(ROOT / "xla_ext"), "-I", str(CUDA_DIR)]
    if source.suffix == ".cu":
        return [*includes, f"-arch={ARCH}", "--fmad=false", "-Werror=all-warnings",
                "-Xcompiler", "-Wall,-Wextra,-Werror"]
    if source.name == "nccl_api.cc" and _nccl_include():  # as cuda.cmake: checked against it
        includes += ["-DTRAINSPEC_HAVE_NCCL_H", "-isystem", _nccl_include()]
    return [*includes, "-isystem", jax.ffi.include_dir(), "-isystem", nanobind.include_dir(),
            "-isystem", sysconfig.get_paths()["include"], '-DTRAINSPEC_JAXLIB_VERSION="test"',
            "-Xcompiler", "-Wall,-Wextra,-Werror"]


@pytest.fixture(scope="module")
def compiled(nvcc, tmp_path_factory) -> dict[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("cuda_objects")

    def compile_one(source: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [nvcc, "-std=c++17", "-O2", "-c", str(source), "-o", str(out / (source.name + ".o")),
             *_flags(source)], capture_output=True, text=True, timeout=600)

    sources = _sources()
    start, cpu_start = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = dict(zip(sources, pool.map(compile_one, sources)))
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\n{len(sources)} CUDA sources compiled by {nvcc}: {time.perf_counter() - start:.1f} s "
          f"wall, {cpu.ru_utime + cpu.ru_stime - cpu_start.ru_utime - cpu_start.ru_stime:.1f} s "
          f"CPU", file=sys.stderr)
    return {out / (source.name + ".o"): result for source, result in results.items()}


def test_every_cuda_source_compiles(compiled):
    assert {obj.name.split(".")[1] for obj in compiled} == {"cu", "cc"}
    failed = {obj.name: r.stderr[-3000:] for obj, r in compiled.items() if r.returncode != 0}
    assert not failed, failed
    assert all(obj.stat().st_size > 0 for obj in compiled)

