"""The C++ harness of xla_ext (tests/cxx/harness.cc) under ThreadSanitizer.

The harness drives the collectives core -- rendezvous, policies, kernels -- from threads with
no Python or XLA in between: every op against a reference, both work plans, two groups and
repeated invocations of one call site, and every failure path (deadline, duplicate rank,
group-size mismatch, disagreeing attributes or shapes, bad operands). Built here with
`-fsanitize=thread` through its own CMake project, it must pass every check with no race
reported, under each kernel variant the CPU runs; the variants' kernel digests must agree.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ISAS = ("baseline", "avx2", "avx512")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    # This environment's cmake first: the test extra installs it beside this Python.
    cmake = shutil.which("cmake", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert cmake, "no cmake: it is a test dependency (pip install -e '.[test]')"
    build = tmp_path_factory.mktemp("xla_ext_harness")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = subprocess.run(
        [cmake, "-S", str(ROOT / "tests" / "cxx"), "-B", str(build), *generator,
         "-DCMAKE_BUILD_TYPE=Debug", "-DCMAKE_CXX_FLAGS=-fsanitize=thread -O1 -g"],
        capture_output=True, text=True, timeout=300)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    compiled = subprocess.run([cmake, "--build", str(build), "-j", "2"], capture_output=True,
                              text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stdout[-5000:] + compiled.stderr[-3000:]
    return build / "xla_ext_harness"


def _run(harness, isa):
    env = dict(os.environ, TRAINSPEC_XLA_EXT_ISA=isa, TSAN_OPTIONS="exitcode=66")
    proc = subprocess.run([str(harness)], capture_output=True, text=True, timeout=600, env=env)
    output = proc.stdout + proc.stderr
    assert "ThreadSanitizer" not in output, output[-6000:]
    assert proc.returncode == 0, output[-6000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines()[-3:-1])
    return lines["isa"], lines["kernel"]


def test_harness_passes_under_thread_sanitizer_with_every_kernel_variant(harness):
    digests = {}
    for isa in ISAS:  # a variant the CPU lacks runs as the best one it has: run each once
        ran, digest = _run(harness, isa)
        digests.setdefault(ran, digest)
    assert len(set(digests.values())) == 1, digests
