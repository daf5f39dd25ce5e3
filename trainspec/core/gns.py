"""Gradient noise scale: the unbiased two-batch estimator, and B_simple of the run's current
state from a window of recent steps (docs/advice.md section 1).

McCandlish et al., "An Empirical Model of Large-Batch Training" (2018), Appendix A.1. With the
squared norms |G_small|^2 and |G_big|^2 of mean gradients over B_small and B_big samples:

    |G|^2  ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(S)  ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)
    B_simple = tr(S) / |G|^2

Both parts are unbiased but noisy (either can be negative on one step), and |G|^2 falls by
orders of magnitude over training, so no fixed average describes the current state: early
steps outweigh late ones for hundreds of steps. The estimate is the ratio of the parts' means
over the longest recent window whose older steps agree with its newer ones within their
noise (Lepski's method), with a Fieller interval for the ratio.
Plain arithmetic only in `unbiased_parts`, so it works on floats, NumPy and traced JAX arrays.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import statistics

import numpy as np

from trainspec.core.errors import UserInputError
from trainspec.core.records import finite_or_none

# Where the small batch comes from (`gns_source` in records).
REPLICAS, MICRO_BATCHES = "replicas", "micro_batches"

CONFIDENCE = 0.90    # of the interval on B_simple
AGREE_Z = 3.0        # older steps disagree when their mean is further than this many sd away
# steps: the shortest candidate window. The state itself moves from step to step (on the
# default job the held-out B_simple of consecutive states differs by 2-5x), so fewer steps
# measure a few states' swings rather than the run's state; with 14 the estimate is within
# 30 % of the held-out value over its window at 38 of 39 states (docs/advice.md section 1)
MIN_WINDOW = 14
WINDOW_GROWTH = 1.5  # each candidate window is this much longer than the last
MAX_WINDOW = 1024    # steps kept: a window this long is precise to a few % of one step's noise


def unbiased_parts(small_sq, big_sq, b_small, b_big):
    """(|G|^2, tr Sigma) estimates from one step; requires b_big > b_small > 0."""
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


@dataclasses.dataclass(frozen=True)
class Estimate:
    """B_simple over the last `window` steps. `low`/`high`: the CONFIDENCE interval, None where
    unbounded (high: |G|^2 not distinguishable from 0) or unknown (too few steps).
    `trend_limited`: the steps before the window disagree with it, so the window is as long as
    the noise scale's movement allows, not as long as the run."""

    grad_sq: float   # mean of the per-step |G|^2 estimates over the window
    trace: float     # mean of the per-step tr Sigma estimates
    b_simple: float | None  # trace / grad_sq; None unless both are positive
    low: float | None
    high: float | None
    window: int
    trend_limited: bool


def window_lengths(n: int) -> list[int]:
    """Candidate windows for n steps: MIN_WINDOW growing by WINDOW_GROWTH, then n itself."""
    lengths, k = [], MIN_WINDOW
    while k < n:
        lengths.append(k)
        k = max(k + 2, round(k * WINDOW_GROWTH))
    return lengths + [n]


class _Newest:
    """Means and noise of the newest k values of a series, each in O(1). The noise variance is
    half the mean squared step-to-step difference: a smooth trend barely enters it."""

    def __init__(self, values: np.ndarray):
        newest_first = values[::-1]
        self.sums = np.concatenate([[0.0], np.cumsum(newest_first)])
        diffs = np.diff(newest_first)
        self.diff_sq = np.concatenate([[0.0], np.cumsum(diffs * diffs)])

    def mean(self, k: int) -> float:
        return self.sums[k] / k

    def noise(self, k: int) -> float:
        return self.diff_sq[k - 1] / (2 * (k - 1))


def choose_window(grad_sq: np.ndarray, trace: np.ndarray) -> tuple[int, bool]:
    """(window, trend_limited): the longest candidate window whose mean of each part agrees with
    the mean of every shorter candidate. Under a constant mean, the newest j of k values differ
    from all k by sd sqrt(noise (1/j - 1/k)) (the older k - j are independent of the newest j)."""
    parts = [_Newest(grad_sq), _Newest(trace)]
    lengths = window_lengths(len(grad_sq))
    chosen = lengths[0]
    for i, k in enumerate(lengths[1:], 1):
        # the noise is estimated from k steps: Student's t at AGREE_Z's tail, not AGREE_Z itself
        q = t_quantile(statistics.NormalDist().cdf(AGREE_Z), k - 1)
        for part in parts:
            noise = part.noise(k)
            for j in lengths[:i]:
                if abs(part.mean(k) - part.mean(j)) > q * math.sqrt(noise * (1 / j - 1 / k)):
                    return chosen, True
        chosen = k
    return chosen, False


def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile by the Cornish-Fisher expansion (Abramowitz & Stegun 26.7.5):
    within 1.5% for dof >= 2 at p = 0.95 (the interval) and dof >= 5 at p = 0.99865 (the
    window test), which is all this module asks of it; SciPy stays off the training path."""
    z = statistics.NormalDist().inv_cdf(p)
    terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96,
             (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384)
    return z + sum(term / dof**n for n, term in enumerate(terms, 1))


def ratio_interval(grad_sq: float, trace: float, var_g: float, var_t: float, cov: float,
                   q: float) -> tuple[float | None, float | None]:
    """Fieller's interval for trace/grad_sq, given the means' variances and covariance: the b
    with (trace - b grad_sq)^2 <= q^2 var(trace - b grad_sq). Bounded when grad_sq is
    significantly above 0; otherwise [low, inf), or no bound at all."""
    a = grad_sq**2 - q * q * var_g
    b = trace * grad_sq - q * q * cov
    c = trace**2 - q * q * var_t
    disc = b * b - a * c
    if a > 0:
        root = math.sqrt(max(disc, 0.0))
        low, high = (b - root) / a, (b + root) / a
    elif disc > 0:  # the set is outside the roots: its upper part is [larger root, inf)
        low, high = (b - math.sqrt(disc)) / a, None
    else:
        low, high = None, None
    return (low if low is not None and low > 0 else None), high


def estimate(grad_sq, trace) -> Estimate:
    """B_simple of the newest state from per-step part estimates (oldest first, all finite)."""
    grad_sq, trace = np.asarray(grad_sq, np.float64), np.asarray(trace, np.float64)
    n = len(grad_sq)
    window, trend_limited = choose_window(grad_sq, trace) if n > MIN_WINDOW else (n, False)
    g, t = grad_sq[-window:], trace[-window:]
    mean_g, mean_t = float(g.mean()), float(t.mean())
    b_simple = mean_t / mean_g if mean_g > 0 and mean_t > 0 else None
    low = high = None
    if window >= 3:
        dg, dt = np.diff(g), np.diff(t)

        def of_mean(a, b):  # (co)variance of the means: successive-difference noise / window
            return float(a @ b) / (2 * (window - 1) * window)

        low, high = ratio_interval(mean_g, mean_t, of_mean(dg, dg), of_mean(dt, dt),
                                   of_mean(dg, dt), t_quantile(0.5 + CONFIDENCE / 2, window - 1))
    return Estimate(mean_g, mean_t, b_simple, low, high, window, trend_limited)


class NoiseScale:
    """The newest MAX_WINDOW steps' part estimates, and the estimate from them."""

    def __init__(self):
        self.steps: collections.deque = collections.deque(maxlen=MAX_WINDOW)

    def update(self, grad_sq: float, trace: float) -> None:
        self.steps.append((float(grad_sq), float(trace)))

    def estimate(self) -> Estimate | None:
        if not self.steps:
            return None
        grad_sq, trace = np.asarray(self.steps).T
        return estimate(grad_sq, trace)


def record_fields(est: Estimate | None) -> dict:
    """The `gns*` fields of a metrics record (core/metrics.schema.json); all null when nothing
    was measured."""
    if est is None:
        return {"gns_grad_sq": None, "gns_trace": None, "gns": None, "gns_low": None,
                "gns_high": None, "gns_window_steps": None, "gns_trend_limited": None}
    return {"gns_grad_sq": finite_or_none(est.grad_sq), "gns_trace": finite_or_none(est.trace),
            "gns": finite_or_none(est.b_simple), "gns_low": finite_or_none(est.low),
            "gns_high": finite_or_none(est.high), "gns_window_steps": est.window,
            "gns_trend_limited": est.trend_limited}


def resolve(setting: bool | None, replicas: int, micro_batches: int,
            gradient_visible: bool) -> tuple[str | None, str | None]:
    """(where the step's small batch comes from, or None; why not, in one line, or None).

    `setting` is `metrics.gns` (None = on when possible). Asking for it where it cannot be
    measured is an error naming the field, rather than a run that silently records nothing.
    """
    if setting is False:
        return None, "metrics.gns = false"
    if not gradient_visible:
        why_not = ("the step is opaque (its gradient is not visible): build it with "
                   "trainspec.jax.loss_step or trainspec.jax.grad_step")
    elif replicas > 1:
        return REPLICAS, None
    elif micro_batches > 1:
        return MICRO_BATCHES, None
    else:
        why_not = "one data-parallel replica and one micro-batch give no second batch size"
    if setting:
        raise UserInputError(f"metrics.gns = true cannot be measured: {why_not}")
    return None, why_not
