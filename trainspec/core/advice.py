"""Batch-size advice from a measured noise scale (docs/advice.md section 2). Framework-free.

McCandlish et al. (2018), eq. 2.11: reaching a given loss takes S steps and E = S·B examples
(tokens here) with (S/S_min − 1)(E/E_min − 1) = 1, i.e. S = S_min (1 + B_noise/B) and
E = E_min (1 + B/B_noise), E_min = S_min·B_noise. The critical batch B_crit = E_min/S_min is
B_noise, estimated by B_simple; at B_crit a run takes 2 S_min steps and 2 E_min tokens.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class TradeOff:
    b_noise: float   # tokens
    s_min: float     # steps with an infinite batch
    e_min: float     # tokens with an infinitesimal batch

    @classmethod
    def from_run(cls, b_noise: float, batch: float, steps: float) -> TradeOff:
        """The trade-off through one observed run: `steps` steps of `batch` tokens."""
        s_min = steps / (1.0 + b_noise / batch)
        return cls(b_noise, s_min, s_min * b_noise)

    def steps(self, batch: float) -> float:
        return self.s_min * (1.0 + self.b_noise / batch)

    def tokens(self, batch: float) -> float:
        return self.e_min * (1.0 + batch / self.b_noise)

    def check(self, batch: float) -> float:
        """(S/S_min − 1)(E/E_min − 1); 1 on the curve."""
        return (self.steps(batch) / self.s_min - 1.0) * (self.tokens(batch) / self.e_min - 1.0)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a global batch of sequences runs on the devices (spec fields)."""

    global_batch: int     # batch.global_batch
    micro_batch: int      # batch.micro_batch
    replicas: int         # product of the data-role axes

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch // self.micro_batch


def recommend_layout(b_crit_tokens: float, seq_len: int, replicas: int,
                     max_rows_per_replica: int) -> Layout:
    """The global batch nearest B_crit that the replicas split evenly (at least one row each),
    and the fewest micro-batches that keep a replica's micro-batch within
    `max_rows_per_replica` rows (the memory the measured run showed to fit)."""
    rows = max(1, round(b_crit_tokens / seq_len / replicas)) * replicas
    per_replica = rows // replicas
    k = math.ceil(per_replica / max(1, max_rows_per_replica))
    while per_replica % k:  # micro-batches must split a replica's rows evenly
        k += 1
    return Layout(rows, rows // k, replicas)


def trend(steps: list[float], values: list[float]) -> float | None:
    """Growth factor of a positive series from its first to its last step, from the
    least-squares slope of log(value) against step (None with fewer than 3 positive values)."""
    points = [(s, math.log(v)) for s, v in zip(steps, values) if v is not None and v > 0]
    if len(points) < 3:
        return None
    n = len(points)
    ms = sum(s for s, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((s - ms) ** 2 for s, _ in points)
    if var == 0:
        return None
    slope = sum((s - ms) * (v - mv) for s, v in points) / var
    return math.exp(slope * (points[-1][0] - points[0][0]))


# An interval on B_crit wider than this factor leaves the recommended batch open by as much.
UNRELIABLE_SPREAD = 2.0


def interval_text(low: float | None, high: float | None) -> str:
    if low is None and high is None:
        return "no bound"
    if high is None:
        return f">= {low:.0f} (no upper bound)"
    return f"{low or 0:.0f}-{high:.0f}"


def reliability(low: float | None, high: float | None, window: int | None,
                trend_limited: bool | None) -> tuple[bool, str]:
    """(reliable, one line): whether the estimate pins B_crit within UNRELIABLE_SPREAD, and why
    not. `trend_limited`: older steps disagreed with the window (gns_trend_limited)."""
    if window is None:
        return False, "unknown: the records give no interval on B_crit"
    spread = high / low if low and high else math.inf
    interval = interval_text(low, high)
    if spread > UNRELIABLE_SPREAD and trend_limited:
        return False, (
            f"unreliable: B_crit moves faster than it can be measured: the steps before the "
            f"last {window} disagree with them (the noise scale grows as the loss falls), and "
            f"{window} steps pin it only within {interval} tokens. No single batch size fits "
            "this run; train further and advise again, or grow the batch with B_crit")
    if spread > UNRELIABLE_SPREAD:
        return False, (f"uncertain: the {window} steps measured pin B_crit only within "
                       f"{interval} tokens; a longer run narrows it")
    if trend_limited:
        return True, (f"B_crit is moving: older steps disagree with the last {window}, which "
                      f"agree within their noise (interval x{spread:.2f}); the estimate is their "
                      "average, and lags B_crit while it moves")
    return True, f"steady over the {window} steps measured (interval x{spread:.2f})"
