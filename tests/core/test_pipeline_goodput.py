"""The pipeline bubble as its own badput line, and the executed schedule a run records
(trainspec.core.goodput, trainspec.core.pipeline.schedule.run_record)."""
from __future__ import annotations

import pytest

from trainspec.core.goodput import Goodput
from trainspec.core.pipeline.schedule import run_record
from trainspec.core.spec import load_spec


def test_the_bubble_moves_from_productive_time_to_its_badput_line():
    g = Goodput(start=0.0, bubble=0.25)
    g.interval(10, 1.0, 0.0)
    s = g.summary(now=2.0)
    assert s["badput_s"]["pipeline_bubble"] == pytest.approx(0.25)
    assert s["productive_s"] == pytest.approx(0.75) and s["goodput"] == pytest.approx(0.375)
    assert sum(s["badput_s"].values()) + s["productive_s"] == pytest.approx(2.0)


def test_a_run_records_the_executed_gpipe_slots():
    spec = load_spec(None, ['mesh.axes={data={size=-1},stage={role="pipeline",size=2}}',
                            'pipeline.schedule="gpipe"', "pipeline.microbatches=3"])
    record = run_record(spec, {"data": 4, "stage": 2})
    assert record["slots"] == ["F0 F1 F2 . . B2 B1 B0", ". F0 F1 F2 B2 B1 B0 ."]
    assert record["idle_fraction"] == pytest.approx(1 / 4)
    assert run_record(load_spec(None), {"data": 8, "fsdp": 1, "tensor": 1}) is None
