"""The schedule the torch pipeline executed (trainspec.torch.pipeline.ExecutedOrder), recorded
on each rank during the second step of pipeline 2 with m = 8 micro-batches: each stage ran the
core's order for its schedule, operation for operation; those orders, run under the core's cost
model (schedule.execute: F = B = one slot), pass the dependency check and idle (p−1)/(m+p−1) of
the slots; the activations each stage held (its forward cache) peaked at m micro-batches under
GPipe and at p − stage under 1F1B; and the bytes it held for its backwards (the tensors autograd
saved and the forward cache's) were, at every operation's start and at the step's end, one
micro-batch's bytes times the micro-batches held: GPipe's peak m times one micro-batch's, 1F1B's
p − stage times. Interleaved 1F1B (v = 2 chunks per stage, one layer each) runs the core's
interleaved order and idles (p−1)/(v·m+p−1)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainspec.core.pipeline.schedule import Op, bubble_formula, execute, orders

pytest.importorskip("torch", reason="the torch extra")
pytestmark = pytest.mark.slow  # a 2-rank job per schedule

WORKER = Path(__file__).with_name("torch_pipeline_schedule_worker.py")
P, M = 2, 8


def executed(schedule: str, virtual: int, tmp_path) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", str(P), "--",
         sys.executable, str(WORKER), schedule, str(virtual)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return json.loads(re.search(r"EXECUTED (.*)", out).group(1))


# peak: the most chunk activations each stage held; interleaved (v = 2): the core's cost model
# says 5 and 3 (schedule.execute(...).peak_in_flight()), each chunk half a stage's layers
@pytest.mark.parametrize("schedule, virtual, peak", [
    ("gpipe", 1, [M, M]), ("1f1b", 1, [P, P - 1]), ("interleaved_1f1b", 2, [5, 3])])
def test_torch_runs_the_core_s_orders_with_the_formula_s_bubble(schedule, virtual, peak,
                                                                tmp_path):
    stages = executed(schedule, virtual, tmp_path)
    ran = [[Op(*op) for op in stage["ops"]] for stage in stages]
    assert ran == orders(schedule, P, M, virtual)
    timeline = execute(ran, virtual)  # checks every dependency
    assert timeline.idle_fraction() == pytest.approx(bubble_formula(schedule, P, M, virtual),
                                                     abs=1e-12)
    print(f"{schedule}: idle fraction {timeline.idle_fraction():.4f}, held at most "
          f"{[max(s['held']) for s in stages]} chunk activations per stage, "
          f"{[max(s['held_bytes']) for s in stages]} bytes")
    assert [max(stage["held"]) for stage in stages] == timeline.peak_in_flight() == peak
    if virtual > 1:  # chunks differ (the embedding's, the head's): bytes are not counts
        return
    for stage in stages:
        # the bytes held for the backwards at each operation's start and at the step's end
        # are one micro-batch's times the micro-batches held: nothing else stays (the outputs
        # included: torch's default keeps the last stage's logits until the step's end)
        held = [0, *stage["held"]]
        per_microbatch = stage["held_bytes"][1]
        assert per_microbatch > 0
        assert stage["held_bytes"] == [n * per_microbatch for n in held]
