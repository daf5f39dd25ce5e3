"""A third implementation runs the suite through the door for implementations outside the
repository: `trainspec conformance --impl module:Class`, or a name registered under the
`trainspec.implementations` entry points by an installed package (here a .dist-info directory on
PYTHONPATH, as pip would leave it). A bad --impl is one line naming it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _conformance(*argv, path=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), str(HERE)])}
    return subprocess.run([sys.executable, "-m", "trainspec.cli.main", "conformance", *argv],
                          capture_output=True, text=True, env=env, timeout=300)


def _table(stdout: str) -> dict[str, str]:
    return {line[:20].strip(): line[20:] for line in stdout.splitlines()[2:]}


def test_module_class_runs_the_suite():
    done = _conformance("--impl", "numpy_impl:NumpyAdapter", "--quick")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _table(done.stdout)
    assert rows["total"].split()[-1] == "pass"
    assert rows["reference trajectory"].split()[:3] == ["3", "3", "0"]
    assert "5 refused by its capability table: fsdp: mesh.axes.*.size" in rows["layout invariance"]


def test_a_registered_implementation_runs_by_name(tmp_path):
    dist = tmp_path / "numpy_impl-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: numpy-impl\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[trainspec.implementations]\nnumpy = numpy_impl:NumpyAdapter\n")
    done = _conformance("--impl", "numpy", "--quick", path=[tmp_path])
    assert done.returncode == 0 and "conformance of numpy" in done.stdout, done.stdout + done.stderr
    table = _conformance("--capabilities", path=[tmp_path])
    assert table.stdout.splitlines()[0] == "| field | jax | torch | numpy |", table.stdout[:500]


def test_a_failing_implementation_exits_1_naming_the_case():
    done = _conformance("--impl", "broken_impls:DoNothing", "--quick")
    assert done.returncode == 1
    assert "FAIL: adamw: step 1: loss 5.5, reference 6.261992" in done.stdout


@pytest.mark.parametrize("impl,message", [
    ("nosuch", "--impl nosuch: not an implementation; one of xla, ext, hierarchical, torch"),
    ("nosuch_module:X", "--impl nosuch_module:X: cannot import 'nosuch_module'"),
    ("numpy_impl:NoSuchClass",
     "--impl numpy_impl:NoSuchClass: numpy_impl has no Adapter subclass 'NoSuchClass'"),
    ("numpy_impl:NUMPY", "numpy_impl has no Adapter subclass 'NUMPY'"),
])
def test_a_bad_impl_is_one_line(impl, message):
    done = _conformance("--impl", impl)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout
