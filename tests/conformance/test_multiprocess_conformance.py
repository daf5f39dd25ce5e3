"""The conformance suite across 2 processes x 4 CPU devices (jax.distributed over gloo).

`multiprocess_worker.py` runs the suite's own checks in each process, on meshes whose leading
axis is the process, so the hierarchical backend takes all of its paths: ext within a process,
lax (gloo) across, and both stages. About a minute on 2 loaded cores. A check that hangs is
named by the worker's watchdog, with both processes' stacks, well before the timeout here.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("multiprocess_worker.py")


@pytest.mark.parametrize("backend", ["hierarchical"])
def test_conformance_across_two_processes(backend):
    result = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", "2", "--grace", "2",
         "--", sys.executable, str(WORKER), backend],
        capture_output=True, text=True, timeout=400,
    )
    out = result.stdout + result.stderr
    results = re.findall(r"RESULT backend=\S+ process=(\d) passed=(\d+) skipped=\d+ failed=(\d+)", out)
    failures = "\n".join(line for line in out.splitlines() if "FAIL" in line)[:4000]
    hang = out[out.find("HANG"):][:8000] if "HANG" in out else ""  # the worker's watchdog
    assert result.returncode == 0, failures + hang or out[-4000:]
    assert sorted(p for p, _, _ in results) == ["0", "1"], out[-4000:]
    # Both processes ran every check; a worker that silently ran nothing must not pass.
    assert all(int(passed) >= 250 and failed == "0" for _, passed, failed in results), results
