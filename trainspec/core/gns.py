"""Gradient noise scale: the unbiased two-batch estimator and its smoothing (docs/advice.md).

McCandlish et al., "An Empirical Model of Large-Batch Training" (2018), Appendix A.1. With the
squared norms |G_small|^2 and |G_big|^2 of mean gradients over B_small and B_big samples:

    |G|^2  ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(S)  ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)
    B_simple = tr(S) / |G|^2

Both parts are unbiased but noisy (either can be negative on one step); their ratio is not
unbiased, so each part is smoothed first and the ratio taken of the smoothed parts.
Plain arithmetic only, so `unbiased_parts` works on floats, NumPy and traced JAX arrays alike.
"""
from __future__ import annotations

import dataclasses

# Weight of the past in the EMA of each part, per step: an effective window of ~20 steps.
EMA_DECAY = 0.95


def unbiased_parts(small_sq, big_sq, b_small, b_big):
    """(|G|^2, tr Sigma) estimates from one step; requires b_big > b_small > 0."""
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


@dataclasses.dataclass
class Ema:
    """Exponential moving average with Adam's bias correction: the mean of what it has seen
    weighted by decay**age, normalised by the weights' sum (so the first value is exact)."""

    decay: float = EMA_DECAY
    biased: float = 0.0
    weight: float = 0.0

    def update(self, value: float) -> None:
        self.biased = self.decay * self.biased + (1.0 - self.decay) * value
        self.weight = self.decay * self.weight + (1.0 - self.decay)

    @property
    def value(self) -> float | None:
        return self.biased / self.weight if self.weight > 0 else None


@dataclasses.dataclass
class NoiseScale:
    """Smoothed |G|^2 and tr Sigma from per-step estimates, and B_simple from them."""

    grad_sq: Ema = dataclasses.field(default_factory=Ema)
    trace: Ema = dataclasses.field(default_factory=Ema)

    def update(self, grad_sq: float, trace: float) -> None:
        self.grad_sq.update(float(grad_sq))
        self.trace.update(float(trace))

    @property
    def b_simple(self) -> float | None:
        """tr Sigma / |G|^2 of the smoothed parts; None until |G|^2 is positive."""
        g, t = self.grad_sq.value, self.trace.value
        return t / g if g is not None and g > 0 else None
