"""`trainspec advise`: batch-size advice from a run's measured noise scale (docs/advice.md §2).

Reads the run's metric records (the last record's `gns`, over the recent steps that agree with
the run's current state, is the estimate; its interval says how far to trust it), applies the
steps/tokens trade-off through the observed run, and lays the critical batch out on the spec's
devices. Time per step at another batch on the same devices is scaled by tokens per step (the
per-token cost measured by the run, compute-bound); docs/advice.md states this assumption.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from trainspec.core.advice import (
    Layout, TradeOff, interval_text, recommend_layout, reliability, trend)
from trainspec.core.errors import UserInputError
from trainspec.core.gns import CONFIDENCE
from trainspec.report import plots
from trainspec.core.mesh import resolve_mesh
from trainspec.core.records import read_jsonl
from trainspec.core.spec import Spec

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


def plot(advice: dict, out: Path) -> Path:
    plt = plots.pyplot()
    import numpy as np

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


def write_json(advice: dict, out: Path) -> None:
    Path(out).write_text(json.dumps(advice, indent=2) + "\n")
