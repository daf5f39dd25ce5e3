"""Scaling-law fits (docs/advice.md section 3). Framework-free: NumPy and SciPy only.

Both laws are sums of an irreducible loss and power laws, fitted the way Hoffmann et al.
(2022, "approach 3") fit L(N, D): minimise the Huber loss (delta 1e-3) of
log L̂ − log L with L-BFGS from a grid of starting points, where
log L̂ = logsumexp(e, a_1 − α_1 log(x_1/x̄_1), ...) so every term stays positive:

    L(C)    = L∞ + a·C^(−b)                  (x = compute)
    L(N, D) = E + A/N^α + B/D^β              (x = parameters, tokens)

Each x is divided by its geometric mean x̄ before fitting (the grid and the optimiser then see
O(1) numbers); the reported coefficients are for the raw x. Uncertainty is a bootstrap over
points; a prediction interval adds a resampled residual of the fit to each bootstrap
prediction, so it covers a new run's own scatter, not only the curve's.

`trainspec scaling RUN...` fits them over a sweep's runs (`read_points`, `fit_points`).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp

from trainspec.core.errors import UserInputError

HUBER_DELTA = 1e-3  # Hoffmann et al.: nearly L1 on log-loss, robust to outlying runs
CONFIDENCE = 0.95


def _huber(r):
    a = np.abs(r)
    quad = a <= HUBER_DELTA
    loss = np.where(quad, 0.5 * r**2, HUBER_DELTA * (a - 0.5 * HUBER_DELTA))
    grad = np.where(quad, r, HUBER_DELTA * np.sign(r))
    return loss, grad


def _log_pred(theta, logx):
    """theta = (e, a_1, α_1, a_2, α_2, ...); logx: (n, k) centred log inputs."""
    terms = [np.full(logx.shape[0], theta[0])]
    terms += [theta[1 + 2 * i] - theta[2 + 2 * i] * logx[:, i] for i in range(logx.shape[1])]
    return np.stack(terms)


def _objective(theta, logx, logy):
    terms = _log_pred(theta, logx)
    pred = logsumexp(terms, axis=0)
    loss, dr = _huber(pred - logy)
    weights = np.exp(terms - pred) * dr  # d pred / d term_j = softmax_j
    grad = np.empty_like(theta)
    grad[0] = weights[0].sum()
    for i in range(logx.shape[1]):
        grad[1 + 2 * i] = weights[1 + i].sum()
        grad[2 + 2 * i] = -(weights[1 + i] * logx[:, i]).sum()
    return loss.sum(), grad


def _fit_from(starts, logx, logy):
    best = None
    for theta0 in starts:
        # BFGS rather than Hoffmann et al.'s L-BFGS: the same answer on 3-5 parameters, and
        # scipy's L-BFGS-B calls a threaded BLAS on tiny matrices, ~10x slower on a busy machine
        res = minimize(_objective, np.asarray(theta0, float), args=(logx, logy), jac=True,
                       method="BFGS")
        if best is None or res.fun < best.fun:
            best = res
    return best.x


def _grid(k: int, logy):
    """Starting points: e around the smallest loss, a around the spread, α in a plausible range."""
    lo = float(np.min(logy))
    es = (lo - 1.0, lo - 0.1)
    a_s = (lo - 2.0, lo - 0.5)
    alphas = (0.2, 0.7)
    per_var = list(itertools.product(a_s, alphas))
    for e, rest in itertools.product(es, itertools.product(per_var, repeat=k)):
        yield [e, *itertools.chain.from_iterable(rest)]


@dataclasses.dataclass(frozen=True)
class Fit:
    """A fitted law over variables `names` (e.g. ("compute",) or ("params", "tokens"))."""

    names: tuple[str, ...]
    theta: np.ndarray          # centred parameters
    log_ref: np.ndarray        # log of each variable's geometric mean
    residuals: np.ndarray      # log L̂ − log L at the data
    boot: np.ndarray           # bootstrap thetas, (n_boot, len(theta))
    boot_residuals: np.ndarray  # residuals drawn for each bootstrap prediction

    def predict(self, *x, theta=None):
        """Loss at x (one array or scalar per variable)."""
        theta = self.theta if theta is None else theta
        logx = np.log(np.stack([np.atleast_1d(np.asarray(v, float)) for v in x], axis=1))
        logx = logx - self.log_ref
        return np.exp(logsumexp(_log_pred(theta, logx), axis=0))

    def coefficients(self, theta=None) -> dict[str, float]:
        """{"irreducible": L∞ or E, "coef_<name>": A, "exp_<name>": α} for raw inputs."""
        theta = self.theta if theta is None else theta
        out = {"irreducible": float(np.exp(theta[0]))}
        for i, name in enumerate(self.names):
            a, alpha = theta[1 + 2 * i], theta[2 + 2 * i]
            out[f"coef_{name}"] = float(np.exp(a + alpha * self.log_ref[i]))
            out[f"exp_{name}"] = float(alpha)
        return out

    def intervals(self) -> dict[str, tuple[float, float]]:
        """Bootstrap percentile interval of every coefficient."""
        q = [(1 - CONFIDENCE) / 2 * 100, (1 + CONFIDENCE) / 2 * 100]
        per_boot = [self.coefficients(t) for t in self.boot]
        return {k: tuple(float(v) for v in np.percentile([c[k] for c in per_boot], q))
                for k in per_boot[0]}

    def predict_interval(self, *x) -> tuple[float, float, float]:
        """(prediction, low, high) of one new run's loss: bootstrap curve plus residual."""
        curves = np.array([self.predict(*x, theta=t)[0] for t in self.boot])
        runs = curves * np.exp(-self.boot_residuals)
        q = [(1 - CONFIDENCE) / 2 * 100, (1 + CONFIDENCE) / 2 * 100]
        low, high = np.percentile(runs, q)
        return float(self.predict(*x)[0]), float(low), float(high)


def fit(names: tuple[str, ...], x: np.ndarray, loss: np.ndarray, n_boot: int = 100,
        seed: int = 0) -> Fit:
    """Fit L = exp(e) + Σ_i exp(a_i)·(x_i/x̄_i)^(−α_i); x: (n, k) positive, loss: (n,)."""
    x, loss = np.asarray(x, float).reshape(len(loss), -1), np.asarray(loss, float)
    log_ref = np.log(x).mean(axis=0)
    logx, logy = np.log(x) - log_ref, np.log(loss)
    theta = _fit_from(list(_grid(x.shape[1], logy)), logx, logy)
    residuals = logsumexp(_log_pred(theta, logx), axis=0) - logy
    rng = np.random.default_rng(seed)
    boot = np.empty((n_boot, len(theta)))
    for b in range(n_boot):
        idx = rng.integers(0, len(loss), len(loss))
        boot[b] = _fit_from([theta], logx[idx], logy[idx])
    return Fit(tuple(names), theta, log_ref, residuals, boot, rng.choice(residuals, n_boot))


def n_parameters(n_variables: int) -> int:
    """The irreducible term, then a coefficient and an exponent per variable."""
    return 1 + 2 * n_variables


def min_points(n_variables: int) -> int:
    """Points needed for a fit with one degree of freedom left: 1 + 2k parameters, plus one."""
    return n_parameters(n_variables) + 1


def distinct_in_resample(n: int) -> float:
    """Expected number of distinct points in a bootstrap resample of n points (n draws with
    replacement): n·(1 − (1 − 1/n)^n), about 0.63·n."""
    return n * (1 - (1 - 1 / n) ** n)


def points_for_intervals(n_variables: int) -> int:
    """The fewest points whose bootstrap resamples hold, on average, `min_points` distinct
    ones, the rule the fit itself follows: 7 for L(C), 10 for L(N, D)."""
    n = min_points(n_variables)
    while distinct_in_resample(n) < min_points(n_variables):
        n += 1
    return n


MIN_DISTINCT_VALUES = 3  # a·x^(−α) beside the irreducible term: two values give one difference


def underdetermined(names: tuple[str, ...], x: np.ndarray) -> str | None:
    """Why points x (n, k) do not pin down the law over `names`, or None. Two tests, each a
    count the data can be checked against before trusting the fit:
    - every variable takes at least 3 distinct values: with 2, its power law's coefficient
      and exponent rest on one difference of losses, which any exponent can fit;
    - the bootstrap, whose percentiles are the reported intervals, refits resamples that hold
      ~63% distinct points (`distinct_in_resample`); below `points_for_intervals` most
      resamples are themselves under-determined and the intervals mean little."""
    x = np.asarray(x).reshape(len(x), len(names))
    reasons = [f"{name} takes {len(set(x[:, i]))} distinct values (each power law needs "
               f"≥ {MIN_DISTINCT_VALUES})" for i, name in enumerate(names)
               if len(set(x[:, i])) < MIN_DISTINCT_VALUES]
    need = points_for_intervals(len(names))
    if len(x) < need:
        reasons.append(f"{len(x)} points for {n_parameters(len(names))} parameters: a bootstrap "
                       f"resample holds {distinct_in_resample(len(x)):.1f} distinct points on "
                       f"average, so the 95% intervals need ≥ {need} points")
    return "; ".join(reasons) or None


# -- over sweep runs (`trainspec scaling`) ----------------------------------------------------

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


def fit_points(points: list[dict], n_boot: int = 100) -> dict[str, Fit]:
    """L(C) always; L(N, D) when both N and D take at least two values."""
    need = min_points(1)
    if len(points) < need:
        raise UserInputError(f"runs: {len(points)} points are too few to fit L(C) = a C^-b + "
                             f"L_inf (needs {need})")
    loss = np.array([p["loss"] for p in points])
    fits = {"compute": fit(("compute",), np.array([[p["compute"]] for p in points]),
                                   loss, n_boot)}
    n_values = {p["params"] for p in points}
    d_values = {p["tokens"] for p in points}
    if len(n_values) > 1 and len(d_values) > 1 and len(points) >= min_points(2):
        x = np.array([[p["params"], p["tokens"]] for p in points])
        fits["params_tokens"] = fit(("params", "tokens"), x, loss, n_boot)
    return fits


LAWS = {"compute": "L(C)", "params_tokens": "L(N, D)"}  # fit_points' keys, as printed


def caveats(points: list[dict], fits: dict[str, Fit]) -> list[str]:
    """One line per fit the points do not pin down (underdetermined says why)."""
    lines = []
    for key, f in fits.items():
        why = underdetermined(f.names, np.array([[p[n] for n in f.names] for p in points]))
        if why:
            lines.append(f"{LAWS[key]} is under-determined: {why}; its coefficients, intervals "
                         "and predictions are not to be relied on")
    return lines


def describe(fits: dict[str, Fit]) -> dict:
    out = {}
    for key, f in fits.items():
        ci = f.intervals()
        out[key] = {name: {"value": value, "ci95": ci[name]}
                    for name, value in f.coefficients().items()}
        out[key]["rms_log_residual"] = float(np.sqrt(np.mean(f.residuals**2)))
    return out


def predict(fits: dict[str, Fit], params=None, tokens=None, compute=None) -> dict:
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
