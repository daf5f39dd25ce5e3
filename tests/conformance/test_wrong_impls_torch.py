"""Deliberately wrong torch implementations fail the conformance suite (4 gloo ranks), where
the right one passes the same cases: the `experts` family (experts whole over data 4, and
data 2 x expert 2) fails a router whose capacity drops the later rows' assignments first, and
the `data x context` layout case fails a ring whose causal mask is one block off, each at the
first step's loss."""
import json
from pathlib import Path

import pytest

from rank_jobs import launch_worker
from trainspec.core.conformance_experts import EXPERT_CASES

pytest.importorskip("torch", reason="the torch extra")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wrong")
    (tmp / "job.json").write_text(json.dumps({"out": str(tmp / "verdicts.json")}))
    launch_worker(Path(__file__).resolve().parent / "torch_wrong_impls_worker.py",
                  tmp / "job.json", 4)
    return json.loads((tmp / "verdicts.json").read_text())


def test_a_router_dropping_the_wrong_assignments_fails_the_experts_family(verdicts):
    right, broken = verdicts["experts"]["right"], verdicts["experts"]["broken"]
    assert (right["passed"], right["failed"], right["refused"]) == (len(EXPERT_CASES), 0, []), right
    assert broken["failed"] == len(EXPERT_CASES), broken
    assert broken["first_failure"].startswith("experts whole: step 1: loss "), broken


def test_a_ring_with_its_mask_one_block_off_fails_the_context_case(verdicts):
    right, broken = verdicts["context"]["right"], verdicts["context"]["broken"]
    assert right is None, right
    assert broken is not None and broken.startswith("step 1: loss "), broken
