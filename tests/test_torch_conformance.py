"""The torch adapter passes the spec's conformance suite (`trainspec conformance --impl torch`,
8 gloo ranks): every family, every case."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "permute",
            "special values", "illegal calls", "guarantee levels", "accumulation",
            "layout invariance", "metric records"]


def test_torch_passes_the_conformance_suite():
    result = subprocess.run([sys.executable, "-m", "spec_jax.cli.main", "conformance", "--impl",
                             "torch"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    table = {m[1].strip(): (int(m[2]), int(m[3]), int(m[4]))
             for m in re.finditer(r"\[rank 0\] (\w[\w ]*?)\s+(\d+)\s+(\d+)\s+(\d+)  ", result.stdout)}
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert set(FAMILIES) <= set(table), table
    for family, (cases, passed, failed) in table.items():
        assert cases == passed > 0 and failed == 0, (family, table[family])
    assert table["total"][0] >= 600  # every layout x dtype of the core's cases, not a subset
