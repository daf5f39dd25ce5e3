"""A resume to more steps than its checkpoints were planned for keeps their learning-rate
schedule (a resumed run stays bit for bit on its course) and says so in one line; a resume
within the plan says nothing."""
import logging

import pytest

from trainspec.core.run import Run
from trainspec.core.spec import default_spec


class PlannedFor:
    """Checkpoints whose newest was planned for `total` steps: all Run.__enter__ reads."""

    def __init__(self, total):
        self.total = total

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def saved_total_steps(self):
        return self.total


@pytest.mark.parametrize("planned,steps,warns", [(4, 8, True), (8, 8, False), (None, 8, False)])
def test_a_resume_past_the_planned_steps_says_so(tmp_path, caplog, planned, steps, warns):
    with caplog.at_level(logging.WARNING, logger="trainspec"), \
            Run(default_spec(), tmp_path, PlannedFor(planned), steps, progress=False) as run:
        assert run.total_steps == (planned or steps)
    lines = [r.getMessage() for r in caplog.records]
    want = ["--steps 8: the checkpoints were planned for 4 steps; the spec's learning-rate "
            "schedule stays theirs and holds its floor after step 4 (--restart plans it over 8)"]
    assert lines == (want if warns else [])
