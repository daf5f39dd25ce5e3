"""The summary `trainspec train` prints, whichever implementation trained (framework-free)."""
from __future__ import annotations

from trainspec.core.advice import interval_text
from trainspec.core.gns import CONFIDENCE
from trainspec.core.mesh import mesh_text


def print_summary(summary: dict) -> None:
    print(
        f"\n{_trained(summary)} on mesh {mesh_text(summary['mesh'])} "
        f"({plural(summary['accumulation_steps'], 'micro-batch', 'micro-batches')} per step)\n"
        f"  loss           {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}\n"
        f"  tokens/s       {summary['tokens_per_s']:.0f} (mean over the run)\n"
        f"  step time      {summary['step_time_s'] * 1e3:.1f} ms (mean, compile excluded)\n"
        f"  MFU            {_percent(summary.get('mfu'))} (docs/metrics.md; "
        f"compile {summary.get('compile_time_s') or 0:.1f} s, goodput {_percent(summary.get('goodput'))})\n"
        f"  peak           {_peak(summary)}\n"
        f"  comm           {_comm(summary)}\n"
        f"  GNS            {_gns(summary)}\n"
        f"  spec           {summary['spec']}\n"
        f"  metrics        {summary['metrics_file']}"
    )
    for rollback in summary.get("rollbacks") or []:  # the run went back to a checkpoint
        print(f"  rolled back    to step {rollback['restored_step']}: "
              f"{rollback['reason']}")
    if summary.get("eval_loss") is not None:  # [eval]: the newest evaluation
        print(f"  eval loss      {summary['eval_loss']:.4f} (the newest evaluation, [eval])")
    if summary.get("skipped_batches"):
        print(f"  skipped        batches {', '.join(map(str, summary['skipped_batches']))} "
              "(health.nan.policy = rollback)")


def plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def _trained(summary: dict) -> str:
    """The steps this invocation trained and, after a resume, where the run now is."""
    resumed = summary.get("resumed_from") or 0
    trained = f"trained {plural(summary['steps'] - resumed, 'step', 'steps')}"
    return (f"{trained} (resumed at step {resumed}, the run is at step {summary['steps']})"
            if resumed else trained)


def _gns(summary: dict) -> str:
    if summary.get("gns_not_measured"):
        return f"not measured: {summary['gns_not_measured']}"
    if summary.get("gns") is None:
        return "- (no positive |G|^2 estimate yet)"
    interval = interval_text(summary["gns_low"], summary["gns_high"])
    return (f"{summary['gns']:.0f} tokens (B_simple over the last {summary['gns_window_steps']} "
            f"steps, {CONFIDENCE:.0%} interval {interval}; `trainspec advise` reads it)")


def _comm(summary: dict) -> str:
    """Collective bytes per step and device, payload and bus (nccl-tests' factors: what a
    compression saves shows in the bus bytes); under semi_sync amortised over the round."""
    total, bus = summary.get("comm_bytes_per_step"), summary.get("comm_bus_bytes_per_step")
    if total is None:
        return "- (not measured)"
    both = f"{total:,.0f} B payload, {bus:,.0f} B bus" if bus is not None else f"{total:,.0f} B"
    by_axis = summary.get("comm_bytes_by_axis") or {}
    if by_axis:  # which axes carry it: the ring's permutes, the experts' all-to-alls, ...
        both += " (by axis: " + ", ".join(f"{a} {b:,.0f}" for a, b in by_axis.items()) + ")"
    semi = summary.get("semi_sync")
    if not semi:
        return f"{both} per step and device (docs/metrics.md)"
    return (f"{both} per step and device, amortised: inner "
            f"{semi['inner_comm_bytes_per_step']:,.0f} + outer {semi['outer_comm_bytes']:,.0f} "
            f"/ H={semi['inner_steps']} ({semi['groups']} semi_sync groups)")


def _peak(summary: dict) -> str:
    """The MFU denominator and where it came from (measured here, the table, the spec)."""
    peak = summary.get("peak_flops_per_device")
    value = "-" if peak is None else f"{peak:.3g} FLOP/s per device"
    return f"{value} ({summary.get('peak_flops_source', 'source unknown')})"


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"
