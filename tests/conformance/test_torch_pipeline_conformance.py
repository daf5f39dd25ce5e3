"""The conformance suite's `pipeline` family (trainspec.core.conformance_steps.pipeline_row) on
the torch implementation, 4 gloo ranks (pipeline 2 x data 2): the torch pipeline passes it, and
one whose last pipeline micro-batch's loss carries no gradient fails it, naming the case and
the step (torch_pipeline_worker.py). The JAX side: test_pipeline_conformance.py."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra")
pytestmark = pytest.mark.slow  # 4 ranks, the 2-layer job with and without a pipeline, twice

WORKER = Path(__file__).with_name("torch_pipeline_worker.py")


def test_the_torch_pipeline_passes_and_a_dropped_micro_batch_fails(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", "4", "--",
         sys.executable, str(WORKER)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    rows = dict(re.findall(r"RESULT impl=(\S+) (.*)", out))
    assert rows["torch"] == "passed=1 failed=0 refused=0 first_failure=", out[-4000:]
    assert re.fullmatch(r"passed=0 failed=1 refused=0 first_failure=pipeline x data: step \d+: "
                        r"loss \S+, \S+ without the pipeline", rows["drops_last_micro_batch"]), rows
