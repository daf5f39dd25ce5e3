"""`trainspec scaling RUN...`: scaling-law fits over sweep runs (docs/advice.md §3)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainspec.core import scaling
from trainspec.core.errors import UserInputError
from trainspec.report import plots

RESULT = "scaling.json"  # written by `trainspec sweep` into each run directory


def read_points(paths: list[Path]) -> list[dict]:
    """Each path: a run directory with scaling.json, or a sweep directory holding such runs."""
    points = []
    for path in map(Path, paths):
        if (path / RESULT).is_file():
            files = [path / RESULT]
        elif path.is_dir():
            files = sorted(path.glob(f"*/{RESULT}"))
        else:
            raise UserInputError(f"run: {path} is not a directory")
        if not files:
            raise UserInputError(f"run: {path} has no {RESULT} (runs of `trainspec sweep` have one)")
        for f in files:
            try:
                point = json.loads(f.read_text())
                points.append({k: float(point[k]) for k in ("params", "tokens", "compute", "loss")}
                              | {"run": str(f.parent)})
            except (ValueError, KeyError, TypeError) as err:
                raise UserInputError(f"{f}: not a scaling result ({err})") from None
    return points


def fit_points(points: list[dict], n_boot: int = 100) -> dict[str, scaling.Fit]:
    """L(C) always; L(N, D) when both N and D take at least two values."""
    need = scaling.min_points(1)
    if len(points) < need:
        raise UserInputError(f"runs: {len(points)} points are too few to fit L(C) = a C^-b + "
                             f"L_inf (needs {need})")
    loss = np.array([p["loss"] for p in points])
    fits = {"compute": scaling.fit(("compute",), np.array([[p["compute"]] for p in points]),
                                   loss, n_boot)}
    n_values = {p["params"] for p in points}
    d_values = {p["tokens"] for p in points}
    if len(n_values) > 1 and len(d_values) > 1 and len(points) >= scaling.min_points(2):
        x = np.array([[p["params"], p["tokens"]] for p in points])
        fits["params_tokens"] = scaling.fit(("params", "tokens"), x, loss, n_boot)
    return fits


LAWS = {"compute": "L(C)", "params_tokens": "L(N, D)"}  # fit_points' keys, as printed


def caveats(points: list[dict], fits: dict[str, scaling.Fit]) -> list[str]:
    """One line per fit the points do not pin down (scaling.underdetermined says why)."""
    lines = []
    for key, f in fits.items():
        why = scaling.underdetermined(f.names, np.array([[p[n] for n in f.names] for p in points]))
        if why:
            lines.append(f"{LAWS[key]} is under-determined: {why}; its coefficients, intervals "
                         "and predictions are not to be relied on")
    return lines


def describe(fits: dict[str, scaling.Fit]) -> dict:
    out = {}
    for key, f in fits.items():
        ci = f.intervals()
        out[key] = {name: {"value": value, "ci95": ci[name]}
                    for name, value in f.coefficients().items()}
        out[key]["rms_log_residual"] = float(np.sqrt(np.mean(f.residuals**2)))
    return out


def predict(fits: dict[str, scaling.Fit], params=None, tokens=None, compute=None) -> dict:
    """The loss of a larger run with a 95% prediction interval, from each applicable fit."""
    out = {}
    if params is not None and tokens is not None:
        if "params_tokens" not in fits:
            raise UserInputError("--predict-params/--predict-tokens: the runs do not vary both "
                                 "N and D (or are too few), so L(N, D) was not fitted")
        out["params_tokens"] = dict(zip(("loss", "low", "high"),
                                        fits["params_tokens"].predict_interval(params, tokens)))
    if compute is not None:
        out["compute"] = dict(zip(("loss", "low", "high"), fits["compute"].predict_interval(compute)))
    return out


def plot(points: list[dict], fits: dict[str, scaling.Fit], prediction: dict, target: dict,
         out: Path) -> Path:
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
