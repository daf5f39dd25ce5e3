"""Goodput accounting: every badput category the loop can see is fed, and they add up."""
import pytest

from trainspec.core.goodput import Goodput
from trainspec.jax.train import run
from tiny import tiny_spec


def test_lost_steps_move_from_productive_to_lost_progress():
    gp = Goodput(start=0.0)
    for _ in range(4):
        gp.interval(steps=5, wall_s=1.0, data_wait_s=0.2)  # 0.16 s per step at ideal pace
    gp.lose_steps(5)
    s = gp.summary(now=10.0)
    assert s["ideal_step_time_s"] == pytest.approx(0.16)
    assert s["productive_s"] == pytest.approx(0.16 * 15)
    assert s["badput_s"]["lost_progress"] == pytest.approx(0.16 * 5)
    assert s["badput_s"]["data_loading"] == pytest.approx(0.8)
    # Everything is accounted for: productive + badput = elapsed.
    assert s["productive_s"] + sum(s["badput_s"].values()) == pytest.approx(10.0)


def test_a_checkpointed_run_reports_initialization_compile_and_checkpoint_time(tmp_path):
    summary = run(tiny_spec("checkpoint.interval=4", "checkpoint.async_save=false"),
                  tmp_path, steps=8, progress=False)
    badput = summary["badput_s"]
    assert badput["initialization"] > 0
    assert badput["compilation"] > 0
    assert badput["checkpoint_save"] > 0  # two synchronous saves (steps 4 and 8)
    assert badput["checkpoint_restore"] == 0  # a fresh run restores nothing
    again = run(tiny_spec("checkpoint.interval=4", "checkpoint.async_save=false"),
                tmp_path, steps=12, progress=False)  # resumes from step 8
    assert again["resumed_from"] == 8
    assert again["badput_s"]["checkpoint_restore"] > 0
