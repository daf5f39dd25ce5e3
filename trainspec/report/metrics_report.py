"""Summarise metrics JSONL runs in a terminal table and an HTML page with plots (report_page)."""
from __future__ import annotations

import statistics
from pathlib import Path

from trainspec.core.records import read_jsonl
from trainspec.report import page as report_page, spec_diff


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(records: list[dict]) -> dict:
    """One row per run: medians over intervals (robust to the warm-up interval)."""
    last = records[-1]
    return {
        "steps": last["step"],
        "final_loss": last["loss"],
        "eval_loss": next((r["eval_loss"] for r in reversed(records) if "eval_loss" in r), None),
        "step_time_s": _median(r["step_time_s"] for r in records),
        "n_devices": last["n_devices"],
        "tokens_per_s": _median(r["tokens_per_s"] for r in records),
        # throughput per device: the ratio rows compare runs on different device counts
        "tokens_per_s_per_device": _median(r["tokens_per_s"] / r["n_devices"] for r in records
                                           if r["tokens_per_s"] is not None and r["n_devices"]),
        "mfu": _median(r["mfu"] for r in records),
        "hfu": _median(r["hfu"] for r in records),
        "memory_peak_bytes": last["memory_peak_bytes"],
        "comm_bytes_per_step": last["comm_bytes_per_step"],
        "comm_bus_bytes_per_step": last["comm_bus_bytes_per_step"],
        "data_wait_fraction": _median(r["data_wait_fraction"] for r in records),
        "compile_time_s": last["compile_time_s"],
        "goodput": last["goodput"],
        # with experts (absent from other runs' records: "-")
        "moe_load_max_over_mean": _median(r.get("moe_load_max_over_mean") for r in records),
        "moe_dropped_tokens": _median(r.get("moe_dropped_tokens") for r in records),
        "moe_load_balance_loss": last.get("moe_load_balance_loss"),
        "moe_z_loss": last.get("moe_z_loss"),
    }


# (key, header naming the statistic, format[, scale]). Medians are over the records' intervals
# (robust to a slow first one); the train summary prints means over the run instead.
COLUMNS = [
    ("steps", "steps", "{:d}"), ("final_loss", "loss (last)", "{:.4f}"),
    ("eval_loss", "eval loss (last)", "{:.4f}"),
    ("step_time_s", "step ms (median)", "{:.1f}", 1e3),
    ("n_devices", "devices", "{:d}"), ("tokens_per_s", "tokens/s (median)", "{:.0f}"),
    ("tokens_per_s_per_device", "tokens/s per device (median)", "{:.0f}"),
    ("mfu", "MFU % (median)", "{:.2f}", 100), ("hfu", "HFU % (median)", "{:.2f}", 100),
    ("memory_peak_bytes", "mem MiB (compiled peak)", "{:.1f}", 2**-20),
    # payload S and nccl-tests' bus bytes (S x bus factor): a compression's saving shows in bus
    ("comm_bytes_per_step", "comm MiB/step (payload)", "{:.2f}", 2**-20),
    ("comm_bus_bytes_per_step", "comm MiB/step (bus)", "{:.2f}", 2**-20),
    ("data_wait_fraction", "data wait % (median)", "{:.1f}", 100),
    ("compile_time_s", "compile s (last)", "{:.1f}"), ("goodput", "goodput % (last)", "{:.1f}", 100),
    ("moe_load_max_over_mean", "expert load max/mean (median)", "{:.2f}"),
    ("moe_dropped_tokens", "dropped tokens/step (median)", "{:.0f}"),
    ("moe_load_balance_loss", "load-balance loss (last)", "{:.4f}"),
    ("moe_z_loss", "router z-loss (last)", "{:.4f}"),
]


def _cell(value, fmt, scale=1):
    if value is None:
        return "-"
    return fmt.format(value * scale if scale != 1 else value)


def rows(summaries: dict[str, dict]) -> tuple[list[str], list[tuple[bool, list[str]]]]:
    """(headers, [(is a ratio row, cells)]): a row per run, then a ratio row per later run
    against the first (the baseline)."""
    headers = ["run"] + [c[1] for c in COLUMNS]
    out = [(False, [name] + [_cell(s[c[0]], c[2], *c[3:]) for c in COLUMNS])
           for name, s in summaries.items()]
    base = next(iter(summaries.values()))
    for name, s in list(summaries.items())[1:]:
        out.append((True, [f"{name} / first"] + [
            f"{s[c[0]] / base[c[0]]:.3f}x" if s[c[0]] and base[c[0]] else "-" for c in COLUMNS]))
    return headers, out


def table(summaries: dict[str, dict]) -> str:
    """Plain-text table for a terminal: the HTML's table turned on its side (a row per metric,
    a column per run, then a ratio column per later run against the first), so that it stays
    narrow however many metrics there are."""
    headers, body = rows(summaries)
    columns = [["metric"] + headers[1:]] + [cells for _, cells in body]
    lines = [list(row) for row in zip(*columns)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]

    def fmt(line):  # metric names to the left, numbers to the right
        return "  ".join([line[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(line[1:], widths[1:])])

    return "\n".join([fmt(lines[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines[1:]])


def run_names(paths: list[Path]) -> list[str]:
    """Short distinct names: a run directory's name (given, or holding `metrics.jsonl`), else
    the file's stem; the parent directory too when those collide."""
    names = [_run_name(Path(p)) for p in paths]
    if len(set(names)) < len(names):
        names = [f"{Path(p).parent.name}/{Path(p).stem}" for p in paths]
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    return names


def _run_name(path: Path) -> str:
    if path.is_dir():
        return path.resolve().name
    return path.parent.resolve().name if path.name == "metrics.jsonl" else path.stem


def report(paths: list[Path], out: Path, x: str = "step") -> tuple[str, Path]:
    """The terminal tables (metrics, then the spec fields that differ), and `out/index.html`:
    one self-contained page (report_page) whose curves run along `x` (report_page.X_AXES)."""
    runs = {name: read_jsonl(p) for name, p in zip(run_names(paths), paths)}
    summaries = {name: summarize(recs) for name, recs in runs.items()}
    specs = {name: spec_diff.run_spec(p) for name, p in zip(runs, paths)}
    axis = report_page.x_axis(x, runs)  # refused before anything is written
    out.mkdir(parents=True, exist_ok=True)
    page = out / "index.html"
    page.write_text(report_page.page(runs, paths, *rows(summaries), specs, axis))
    return "\n\n".join(filter(None, [table(summaries), spec_diff.table(specs)])), page
