"""Goodput and badput of a run: where its wall-clock time went (ml-goodput-measurement's split).

goodput = productive step time / total time since the run started. Productive time is the step
time of every step at the run's ideal pace (the mean of the interval step times that are at
most median + 3 MAD, per step); the rest of the loop's time is badput: data loading (host time
waiting for input), slow steps (time above the ideal pace), and the categories that happen
outside the loop (initialisation, compilation, checkpoint save/restore, lost progress) which
the loop and other subsystems report with `add`. With a pipeline, the executed schedule's idle
fraction of the productive time is the pipeline bubble (an upper bound: the embedding, the head
and the update run outside the pipeline).
"""
from __future__ import annotations

import statistics
import time

from trainspec.core.health import outlier_threshold

BADPUT = ("initialization", "compilation", "data_loading", "checkpoint_save",
          "checkpoint_restore", "lost_progress", "slow_steps", "pipeline_bubble", "evaluation",
          "other")


def ideal_step_time(step_times: list[float]) -> float | None:
    """Mean of the step times <= median + 3 MAD (outliers such as warm-up steps excluded)."""
    if not step_times:
        return None
    limit = outlier_threshold(step_times, k=3)
    kept = [t for t in step_times if t <= limit]
    return statistics.fmean(kept)


class Goodput:
    def __init__(self, start: float | None = None, bubble: float = 0.0):
        self.start = time.perf_counter() if start is None else start
        self.bubble = bubble  # the pipeline schedule's idle fraction (0 without a pipeline)
        self.badput = dict.fromkeys(BADPUT, 0.0)
        self.steps = 0
        self.loop_s = 0.0          # wall time of recorded intervals
        self.data_wait_s = 0.0
        self._interval_times: list[float] = []  # per-step time of each interval, waits removed
        self._interval_steps: list[int] = []
        self.lost_steps = 0  # steps done, then thrown away by a rollback (and done again)

    def add(self, category: str, seconds: float) -> None:
        if category not in self.badput:
            raise ValueError(f"unknown badput category {category!r}; one of {BADPUT}")
        self.badput[category] += seconds

    def lose_steps(self, steps: int) -> None:
        """`steps` finished steps were discarded (rolled back): their time is lost progress."""
        self.lost_steps += steps

    def interval(self, steps: int, wall_s: float, data_wait_s: float) -> None:
        self.steps += steps
        self.loop_s += wall_s
        self.data_wait_s += data_wait_s
        self._interval_times.append(max(wall_s - data_wait_s, 0.0) / steps)
        self._interval_steps.append(steps)

    def summary(self, now: float | None = None) -> dict:
        total = (time.perf_counter() if now is None else now) - self.start
        ideal = ideal_step_time(self._interval_times)
        ideal_s = ideal if ideal is not None else 0.0
        productive = ideal_s * (self.steps - self.lost_steps)
        badput = dict(self.badput)
        badput["lost_progress"] += ideal_s * self.lost_steps
        badput["data_loading"] += self.data_wait_s
        badput["slow_steps"] += max(self.loop_s - self.data_wait_s - ideal_s * self.steps, 0.0)
        badput["pipeline_bubble"] += productive * self.bubble
        productive -= productive * self.bubble
        accounted = productive + sum(badput.values())
        badput["other"] += max(total - accounted, 0.0)
        return {
            "elapsed_s": total,
            "productive_s": productive,
            "ideal_step_time_s": ideal,
            "goodput": productive / total if total > 0 else None,
            "badput_s": badput,
        }
