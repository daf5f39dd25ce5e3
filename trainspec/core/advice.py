"""Batch-size advice from a measured noise scale (docs/advice.md section 2), and `trainspec
advise` over a run's records. Framework-free: a run of any backend is advised alike.

McCandlish et al. (2018), eq. 2.11: reaching a given loss takes S steps and E = S·B examples
(tokens here) with (S/S_min − 1)(E/E_min − 1) = 1, i.e. S = S_min (1 + B_noise/B) and
E = E_min (1 + B/B_noise), E_min = S_min·B_noise. The critical batch B_crit = E_min/S_min is
B_noise, estimated by B_simple; at B_crit a run takes 2 S_min steps and 2 E_min tokens.

`advise` reads the run's metric records (the last record's `gns`, over the recent steps that
agree with the run's current state, is the estimate; its interval says how far to trust it),
applies the steps/tokens trade-off through the observed run, and lays the critical batch out on
the spec's devices. Time per step at another batch on the same devices is scaled by tokens per
step (the per-token cost measured by the run, compute-bound); docs/advice.md states this
assumption.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from trainspec.core.errors import UserInputError
from trainspec.core.gns import CONFIDENCE
from trainspec.core.mesh import resolve_mesh
from trainspec.core.records import read_jsonl
from trainspec.core.spec import Spec


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


TREND_NOTABLE = 1.5  # a change of GNS by more than this factor over the run is reported as such


def metrics_file(path: Path, spec: Spec) -> Path:
    """RUN_DIR (its `metrics.path`) or a JSONL file."""
    path = Path(path)
    if path.is_dir():
        path = path / spec.metrics.path
    if not path.is_file():
        raise UserInputError(f"run: no metrics file at {path}")
    return path


def gns_records(path: Path) -> list[dict]:
    """The records that measured the noise scale; the last must have an estimate (an older one
    would describe another state)."""
    records = [r for r in read_jsonl(path) if r.get("gns_source") is not None]
    if not records:
        raise UserInputError(
            f"{path}: no gns records (metrics.gns was off, or the run had one data-parallel "
            "replica and one micro-batch)")
    last = records[-1]
    if last["gns"] is None:
        raise UserInputError(
            f"{path}: no B_crit at step {last['step']}: over the last "
            f"{last.get('gns_window_steps')} steps |G|^2 is not above 0 within the noise "
            "(B_crit far above the batch, or too few steps); train longer")
    return records


def _plan(layout: Layout, trade: TradeOff, seq_len: int, step_time: float, batch_tokens: int):
    tokens = layout.global_batch * seq_len
    steps = trade.steps(tokens)
    return {
        "global_batch": layout.global_batch, "micro_batch": layout.micro_batch,
        "data_parallel": layout.replicas, "accumulation_steps": layout.accumulation_steps,
        "batch_tokens": tokens, "steps": steps, "tokens": trade.tokens(tokens),
        "time_s": steps * step_time * tokens / batch_tokens,
    }


def advise(path: Path, spec: Spec) -> dict:
    records = gns_records(metrics_file(path, spec))
    last = records[-1]
    b_noise, batch_tokens, steps = last["gns"], last["batch_tokens"], last["step"]
    seq_len = spec.batch.seq_len
    if batch_tokens != spec.batch.global_batch * seq_len:
        raise UserInputError(
            f"spec: batch.global_batch x batch.seq_len = {spec.batch.global_batch * seq_len} "
            f"tokens, but the run recorded {batch_tokens} per step; pass the run's spec (--spec)")
    replicas = resolve_mesh(spec, last["n_devices"]).replicas
    trade = TradeOff.from_run(b_noise, batch_tokens, steps)
    step_time = statistics.median(r["step_time_s"] for r in records if r["step_time_s"])
    current = Layout(spec.batch.global_batch, spec.batch.micro, replicas)

    def layout(b_crit):
        return recommend_layout(b_crit, seq_len, replicas, max(1, spec.batch.micro // replicas))

    low, high = last.get("gns_low"), last.get("gns_high")
    reliable, reliability_note = reliability(low, high, last.get("gns_window_steps"),
                                             last.get("gns_trend_limited"))
    return {
        "run": str(path),
        "steps": steps,
        "loss": last["loss"],
        "gns_source": last["gns_source"],
        "critical_batch_tokens": b_noise,
        "critical_batch_sequences": b_noise / seq_len,
        "critical_batch_interval": [low, high],  # CONFIDENCE interval; None: no bound
        "window_steps": last.get("gns_window_steps"),
        "reliable": reliable,
        "reliability": reliability_note,
        "s_min": trade.s_min,
        "e_min_tokens": trade.e_min,
        "n_devices": last["n_devices"],
        "current": _plan(current, trade, seq_len, step_time, batch_tokens),
        "recommended": _plan(layout(b_noise), trade, seq_len, step_time, batch_tokens),
        # global batches the interval's ends would recommend (None: no bound)
        "recommended_range": [layout(b).global_batch if b else None for b in (low, high)],
        "trade_off": [{"batch_tokens": b, "steps": trade.steps(b), "tokens": trade.tokens(b)}
                      for b in (b_noise / 4, b_noise / 2, b_noise, 2 * b_noise, 4 * b_noise)],
        "trend": _trend(records),
        "note": _note(b_noise, replicas, seq_len),
    }


def _note(b_noise: float, replicas: int, seq_len: int) -> str | None:
    if b_noise < replicas * seq_len:
        return (f"B_crit is below one sequence per replica ({replicas} x {seq_len} tokens): "
                "the smallest even batch already exceeds it; fewer data-parallel replicas "
                "(more model parallelism, or fewer devices) use the devices better")
    return None


def _trend(records: list[dict]) -> dict:
    records = [r for r in records if r["gns"] is not None]
    steps, values = [r["step"] for r in records], [r["gns"] for r in records]
    factor = trend(steps, values)
    if factor is None:
        note = "too few records to tell a trend"
    elif factor > TREND_NOTABLE or factor < 1 / TREND_NOTABLE:
        note = (f"GNS {'grew' if factor > 1 else 'fell'} x{factor:.2f} from step {steps[0]} to "
                f"{steps[-1]} (it grows as the loss falls): the advice holds for the end of the "
                "run; a batch that grows with it over training spends fewer tokens")
    else:
        note = f"GNS steady (x{factor:.2f} from step {steps[0]} to {steps[-1]})"
    return {"factor": factor, "from_step": steps[0], "to_step": steps[-1], "note": note,
            "steps": steps, "gns": values,
            "interval": [[r.get("gns_low"), r.get("gns_high")] for r in records]}


def text(advice: dict) -> str:
    cur, rec = advice["current"], advice["recommended"]

    def row(name, p):
        return (f"  {name:<12}{p['global_batch']:>8} {p['micro_batch']:>8} {p['data_parallel']:>6}"
                f" {p['batch_tokens']:>10.0f} {p['steps']:>9.0f} {p['tokens']:>12.3g}"
                f" {p['time_s']:>9.1f}")

    return "\n".join([
        f"run {advice['run']}: {advice['steps']} steps, loss {advice['loss']:.4f}, "
        f"GNS from {advice['gns_source']}",
        f"critical batch B_crit = {advice['critical_batch_tokens']:.0f} tokens "
        f"({advice['critical_batch_sequences']:.1f} sequences); "
        f"{CONFIDENCE:.0%} interval {interval_text(*advice['critical_batch_interval'])}, "
        f"from the last {advice['window_steps']} steps",
        f"trade-off to this loss: S = {advice['s_min']:.1f} (1 + B_crit/B) steps, "
        f"E = {advice['e_min_tokens']:.3g} (1 + B/B_crit) tokens",
        f"  {'':<12}{'global':>8} {'micro':>8} {'dp':>6} {'tokens/st':>10} {'steps':>9} "
        f"{'tokens':>12} {'time s':>9}",
        row("current", cur),
        row("recommended", rec),
        f"  the interval's ends recommend a global batch of {_batch_range(advice)}",
        f"reliability: {advice['reliability']}",
        f"trend: {advice['trend']['note']}",
        *([f"note: {advice['note']}"] if advice["note"] else []),
    ])


def _batch_range(advice: dict) -> str:
    low, high = advice["recommended_range"]
    return f"{low or 'any'} to {high or 'any'}"


def write_json(advice: dict, out: Path) -> None:
    Path(out).write_text(json.dumps(advice, indent=2) + "\n")
