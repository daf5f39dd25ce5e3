"""The plots of `trainspec advise` and `trainspec scaling` (the analysis is the core's:
trainspec.core.advice, trainspec.core.scaling)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from trainspec.core.advice import TradeOff
from trainspec.core.gns import CONFIDENCE
from trainspec.core.scaling import Fit
from trainspec.report import plots


def plot_advice(advice: dict, out: Path) -> Path:
    """GNS over the run's steps with its interval, and the steps/tokens trade-off."""
    plt = plots.pyplot()

    trade = TradeOff(advice["critical_batch_tokens"], advice["s_min"], advice["e_min_tokens"])
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(10, 4))
    steps = advice["trend"]["steps"]
    ax_t.plot(steps, advice["trend"]["gns"], marker="o")
    low, high = np.array(advice["trend"]["interval"], dtype=float).T  # None (no bound): a gap
    ax_t.fill_between(steps, low, high, alpha=0.2, label=f"{CONFIDENCE:.0%} interval")
    ax_t.axhline(advice["current"]["batch_tokens"], ls="--", c="gray", label="run's batch")
    ax_t.set(xlabel="step", ylabel="GNS B_simple (tokens)", title="noise scale during training",
             yscale="log")  # it grows by orders of magnitude
    ax_t.legend()
    b = np.geomspace(trade.b_noise / 30, trade.b_noise * 30, 200)
    ax_b.loglog(trade.tokens(b), trade.steps(b), label="(S/S_min-1)(E/E_min-1)=1")
    for name, marker in (("current", "o"), ("recommended", "*")):
        p = advice[name]
        ax_b.plot(p["tokens"], p["steps"], marker, ms=10, label=f"{name} ({p['batch_tokens']} tok)")
    ax_b.plot(trade.tokens(trade.b_noise), trade.steps(trade.b_noise), "x", ms=10, label="B_crit")
    ax_b.set(xlabel="tokens to the same loss", ylabel="steps", title="steps / tokens trade-off")
    ax_b.legend(fontsize=8)
    return plots.save(fig, out)




def plot_scaling(points: list[dict], fits: dict[str, Fit], prediction: dict, target: dict,
                 out: Path) -> Path:
    """The runs, the L(C) fit, the prediction with its interval, and a held-out run."""
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    c = np.array([p["compute"] for p in points])
    ax.scatter(c, [p["loss"] for p in points], label="runs", zorder=3)
    hi = max([c.max()] + [target.get("compute") or 0])
    grid = np.geomspace(c.min() / 2, hi * 2, 200)
    f = fits["compute"]
    coef = f.coefficients()
    ax.plot(grid, f.predict(grid), label=f"L(C) = {coef['coef_compute']:.3g} C^-"
            f"{coef['exp_compute']:.3f} + {coef['irreducible']:.3f}")
    if "compute" in prediction:
        p = prediction["compute"]
        ax.errorbar([target["compute"]], [p["loss"]], yerr=[[p["loss"] - p["low"]],
                    [p["high"] - p["loss"]]], fmt="s", c="C3", capsize=4, label="prediction (95%)")
    if "actual" in target:
        ax.scatter([target["compute"]], [target["actual"]], marker="*", s=120, c="k",
                   label="held-out run", zorder=4)
    ax.set(xscale="log", xlabel="model FLOPs C", ylabel="held-out loss", title="scaling fit")
    ax.legend(fontsize=8)
    return plots.save(fig, out)
