"""The core's pipeline schedules, executed: the measured idle fraction equals the bubble
formula, 1F1B holds at most p micro-batches of activations where GPipe holds m, and the
dependency check catches orders and slot lists that break the stage-to-stage order."""
from __future__ import annotations

from pathlib import Path

import pytest

from trainspec.core.pipeline import table
from trainspec.core.pipeline.schedule import (
    BACKWARD, FORWARD, Op, ScheduleError, Slot, Timeline, bubble_formula, check, execute,
    orders, run)

ROOT = Path(__file__).parents[2]
CASES = [(p, m) for p in (2, 4, 8) for m in sorted({p, 2 * p, 8})]
# F = B (unit slots) and B = 2F (the backward's two matmuls per forward matmul): with free
# transfers both cost models give the formulas exactly, GPipe and 1F1B for any m, the
# interleaved schedule for m a multiple of p (the spec requires it).
COSTS = [(1, 1), (1, 2)]


@pytest.mark.parametrize("forward, backward", COSTS, ids=["F=B", "B=2F"])
@pytest.mark.parametrize("p, m", CASES)
@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_the_measured_idle_fraction_is_the_formula(schedule, v, p, m, forward, backward):
    timeline = run(schedule, p, m, v, forward, backward)
    expected = (p - 1) / ((v * m if schedule == "interleaved_1f1b" else m) + p - 1)
    assert timeline.idle_fraction() == pytest.approx(expected, abs=1e-12)
    assert bubble_formula(schedule, p, m, v) == pytest.approx(expected, abs=1e-12)
    busy = m * v * (forward + backward)
    assert timeline.makespan * p - busy * p == round(expected * timeline.makespan * p)


@pytest.mark.parametrize("p, m", CASES)
def test_1f1b_holds_at_most_p_micro_batches_where_gpipe_holds_m(p, m):
    one_f_one_b, gpipe = run("1f1b", p, m).peak_in_flight(), run("gpipe", p, m).peak_in_flight()
    assert one_f_one_b == [min(p - s, m) for s in range(p)]
    assert max(one_f_one_b) <= p
    assert gpipe == [m] * p


def test_a_stage_runs_each_microbatch_forward_then_backward_once():
    for stage_order in orders("interleaved_1f1b", 4, 8, 2):
        assert sorted(map(str, stage_order)) == sorted(
            str(Op(kind, i, c)) for kind in (FORWARD, BACKWARD) for i in range(8) for c in range(2))


def test_orders_that_wait_on_each_other_deadlock_by_name():
    bad = orders("1f1b", 2, 2)
    bad[1] = [Op(BACKWARD, 0, 0), Op(FORWARD, 0, 0), Op(FORWARD, 1, 0), Op(BACKWARD, 1, 0)]
    with pytest.raises(ScheduleError, match="deadlock: stage 0 at B0, stage 1 at B0"):
        execute(bad)


def test_the_check_catches_a_stage_that_starts_before_its_input_arrives():
    good = run("gpipe", 2, 2)
    check(good, 2)
    early = [list(row) for row in good.slots]
    early[1] = early[1][1:] + [Slot(None)]  # stage 1 one unit early: F0 before stage 0's F0 ends
    with pytest.raises(ScheduleError, match="stage 1 starts F0 at 0 before stage 0 finishes F0 at 1"):
        check(Timeline(early, 1), 2)


def test_the_check_catches_a_dropped_micro_batch():
    slots = [[Slot(None) if s.op == Op(BACKWARD, 1, 0) else s for s in row]
             for row in run("1f1b", 2, 2).slots]
    with pytest.raises(ScheduleError, match="stage 0 never runs B1"):
        check(Timeline(slots, 1), 2)


def test_schedules_the_core_does_not_generate_are_named():
    with pytest.raises(ScheduleError, match="not 'zero_bubble_v'"):
        orders("zero_bubble_v", 2, 2)


def test_docs_pipeline_md_shows_the_table_the_command_prints():
    text = (ROOT / "docs" / "pipeline.md").read_text()
    start = "<!-- python -m trainspec.core.pipeline.table -->\n"
    block = text[text.index(start) + len(start):text.index("<!-- end of the table -->")]
    assert block == table.markdown(), "docs/pipeline.md is stale: paste the command's output"
