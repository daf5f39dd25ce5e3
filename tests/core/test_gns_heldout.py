"""The GNS estimate the default job's records carry, against per-sequence gradients on held-out
data at every state of steps 8-60 (gns_heldout_default_job.json, measured by the command it
names). The estimate is the ratio of the parts' means over its window of steps, so its target is
the same ratio of the held-out parts over the states those steps measured: its 90 % interval
covers that at >= 80 % of the states checked, the point estimate is within 30 % of it at >= 80 %,
and at the last step (what `trainspec advise` reads) too."""
import json
from pathlib import Path

import numpy as np

from trainspec.core.gns import estimate

DUMP = json.loads((Path(__file__).parent / "gns_heldout_default_job.json").read_text())
PARTS = np.asarray(DUMP["run_parts"], np.float64)
HELD = {int(s): (v["grad_sq"], v["trace"]) for s, v in DUMP["held_out"].items()}
CHECKED = range(20, DUMP["steps"] + 1)


def _scored(step: int):
    """(the record's estimate at `step`, the held-out B_simple over its window), or None where
    a state of the window has no held-out measurement."""
    e = estimate(*PARTS[:step].T)
    states = range(step - e.window, step)  # step k measured the state after k - 1 updates
    if not all(s in HELD for s in states):
        return None
    grad_sq, trace = np.mean([HELD[s] for s in states], axis=0)
    return e, trace / grad_sq


def test_the_interval_covers_and_the_estimate_is_near_the_held_out_value_over_its_window():
    scored = [x for x in map(_scored, CHECKED) if x is not None]
    assert len(scored) >= 35  # nearly every checked state has its window's held-out parts
    covered = np.mean([(e.low or 0) <= value <= (e.high or np.inf) for e, value in scored])
    near = np.mean([abs(e.b_simple / value - 1) <= 0.3 for e, value in scored])
    assert covered >= 0.8 and near >= 0.8, (covered, near)


def test_the_last_records_estimate_is_within_30_percent():
    e, value = _scored(DUMP["steps"])
    assert e.window >= 14 and abs(e.b_simple / value - 1) <= 0.3, (e, value)
