"""The conformance suite's `experts` family on torch (4 gloo ranks: experts whole over data 4,
and data 2 x expert 2): the torch implementation passes both cases, and a router whose
capacity drops the later rows' assignments first fails both at the first step's loss."""
import json
from pathlib import Path

import pytest

from rank_jobs import launch_worker
from trainspec.core.conformance_experts import EXPERT_CASES

pytest.importorskip("torch", reason="the torch extra")
pytestmark = pytest.mark.slow


def test_torch_passes_the_experts_family_and_a_wrong_router_fails_it(tmp_path):
    (tmp_path / "job.json").write_text(json.dumps({"out": str(tmp_path / "rows.json")}))
    launch_worker(Path(__file__).resolve().parent / "torch_experts_worker.py",
                  tmp_path / "job.json", 4)
    rows = json.loads((tmp_path / "rows.json").read_text())
    right, broken = rows["right"], rows["broken"]
    assert (right["passed"], right["failed"], right["refused"]) == (len(EXPERT_CASES), 0, []), right
    assert broken["failed"] == len(EXPERT_CASES), broken
    assert broken["first_failure"].startswith("experts whole: step 1: loss "), broken
