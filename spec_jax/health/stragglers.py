"""Straggler detection: a robust outlier rule over per-participant step timings.

Participants are processes. On CPU all simulated devices of a process are threads of one XLA
program that finishes together, so a per-device time inside a step cannot be observed honestly
there; a process's own time per step can (data loading + dispatch, up to where it would wait on
its peers), and that is what a slow host shows at scale too. Each process times its own steps;
at the metrics interval the times are gathered (one small all-gather, at a sync that happens
anyway) and fed here.

Rule (robust to the outliers it looks for): over the last `window` steps, a participant whose
median time exceeds median + k * MAD of all participants' medians is a straggler; a step whose
time (slowest participant) exceeds median + k * MAD of the window's step times is a slow step.
Both also need to exceed the median by `min_excess` (relative), because the MAD of
near-identical timings is ~0 and would flag jitter.
"""
from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from spec_jax.spec import StragglerSpec


def _threshold(values: np.ndarray, k: float, min_excess: float) -> float:
    median = float(np.median(values))
    mad = float(np.median(np.abs(values - median)))
    return median + max(k * mad, min_excess * median)


class StragglerDetector:
    def __init__(self, spec: StragglerSpec, participants: Sequence[str]):
        self.spec, self.participants = spec, list(participants)
        self.window: collections.deque[np.ndarray] = collections.deque(maxlen=spec.window)
        self.slow_steps: list[int] = []
        self.flagged: collections.Counter[str] = collections.Counter()

    def observe(self, step: int, times: Sequence[float]) -> None:
        """One step's time per participant (seconds, in `participants` order)."""
        times = np.asarray(times, dtype=np.float64)
        if len(self.window) >= 3:  # judge the step against the window before it joins
            history = np.array([t.max() for t in self.window])
            if times.max() > _threshold(history, self.spec.k, self.spec.min_excess):
                self.slow_steps.append(step)
        self.window.append(times)
        for name in self.stragglers():
            self.flagged[name] += 1

    def stragglers(self) -> list[str]:
        """Participants whose windowed median is an outlier among all participants' medians."""
        if len(self.participants) < 3 or len(self.window) < 3:
            return []  # with one or two participants there is no majority to compare against
        medians = np.median(np.stack(self.window), axis=0)
        limit = _threshold(medians, self.spec.k, self.spec.min_excess)
        return [p for p, m in zip(self.participants, medians) if m > limit]

    def report(self) -> dict:
        """For metrics records and the run summary."""
        medians = np.median(np.stack(self.window), axis=0) if self.window else []
        return {
            "stragglers": self.stragglers(),
            "straggler_steps": dict(self.flagged),
            "slow_steps": list(self.slow_steps),
            "median_step_time_s": {p: float(m) for p, m in zip(self.participants, medians)},
        }
