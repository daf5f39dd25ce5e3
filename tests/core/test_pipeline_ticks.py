"""The executed schedule as per-tick tables (trainspec.core.pipeline.ticks), checked by moving
labelled data through them as an SPMD program would: every read finds the data of the
operation that reads it, a buffer's size is the schedule's activation memory (GPipe m
micro-batches, 1F1B at most p), and the slots the tables run (what the JAX pipeline executes)
are the ones a run records, their idle fraction the formula."""
from __future__ import annotations

import pytest

from trainspec.core.pipeline.schedule import bubble_formula, check, run, run_record
from trainspec.core.pipeline.ticks import (
    BACKWARD_KIND, FORWARD_KIND, IDLE_KIND, tables, timeline)
from trainspec.core.spec import load_spec

CASES = [("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
         ("1f1b", 4, 2, 1), ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2)]


def replay(ticks, p: int, v: int) -> list[tuple[str, int, int, int]]:
    """Run the tables with labels for data: each F sends ("act", i, model chunk it feeds), each
    B ("grad", i, model chunk it feeds); return the operations run, asserting every read."""
    last = p * v - 1
    acts = [[None] * (ticks.activation_slots + 1) for _ in range(p)]
    grads = [[None] * (ticks.gradient_slots + 1) for _ in range(p)]
    ran = []
    for t in range(ticks.count):
        sent_on, sent_back = [None] * p, [None] * p
        for s in range(p):
            kind, i, c = ticks.kind[t][s], ticks.microbatch[t][s], ticks.chunk[t][s]
            if kind == IDLE_KIND:
                continue
            k = c * p + s
            if k > 0:  # F and B read the chunk's input; the first chunk reads the batch
                assert acts[s][ticks.input_slot[t][s]] == ("act", i, k), (t, s)
            if kind == FORWARD_KIND:
                sent_on[s] = ("act", i, k + 1)
            else:
                if k < last:
                    assert grads[s][ticks.gradient_slot[t][s]] == ("grad", i, k), (t, s)
                sent_back[s] = ("grad", i, k - 1)
            ran.append(("F" if kind == FORWARD_KIND else "B", i, k, t))
        for s in range(p):  # the two ppermutes, then the unconditional writes
            acts[s][ticks.receive_activation[t][s]] = sent_on[(s - 1) % p]
            grads[s][ticks.receive_gradient[t][s]] = sent_back[(s + 1) % p]
    return ran


@pytest.mark.parametrize("schedule, p, m, v", CASES)
def test_every_read_finds_its_data_and_every_operation_runs_once(schedule, p, m, v):
    ran = replay(tables(run(schedule, p, m, v)), p, v)
    ops = sorted((kind, i, k) for kind, i, k, _ in ran)
    assert ops == sorted((kind, i, k) for kind in "FB" for i in range(m) for k in range(p * v))
    done = {(kind, i, k): t for kind, i, k, t in ran}
    for i in range(m):
        for k in range(1, p * v):
            assert done[("F", i, k - 1)] < done[("F", i, k)]
            assert done[("B", i, k)] < done[("B", i, k - 1)]


def test_a_wrong_slot_is_caught_by_the_replay():
    # the replay is what vouches for the tables: point one backward's read elsewhere and it fails
    ticks = tables(run("1f1b", 2, 4))
    tick = next(t for t, row in enumerate(ticks.kind) if row[1] == BACKWARD_KIND)
    ticks.input_slot[tick][1] = ticks.activation_slots  # the trash slot
    with pytest.raises(AssertionError):
        replay(ticks, 2, 1)


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 4), (4, 8), (8, 16)])
def test_gpipe_holds_m_inputs_and_1f1b_at_most_p(p, m):
    assert tables(run("gpipe", p, m)).activation_slots == m
    assert tables(run("1f1b", p, m)).activation_slots <= p


@pytest.mark.parametrize("schedule, p, m, v", CASES)
def test_the_tables_run_the_recorded_schedule_and_its_bubble_is_the_formula(schedule, p, m, v):
    spec = load_spec(None, [f'mesh.axes={{data={{size=-1}},stage={{role="pipeline",size={p}}}}}',
                            f'pipeline.schedule="{schedule}"', f"pipeline.microbatches={m}",
                            f"pipeline.virtual_stages={v}", f"model.n_layers={p * v}"])
    record = run_record(spec, {"data": 1, "stage": p})
    executed = timeline(tables(run(schedule, p, m, v)), v)
    check(executed, m)
    assert [" ".join(map(str, row)) for row in executed.slots] == record["slots"]
    assert executed.idle_fraction() == pytest.approx(bubble_formula(schedule, p, m, v))
