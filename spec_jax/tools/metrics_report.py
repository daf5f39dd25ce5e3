"""Summarise metrics JSONL runs in a terminal table and an HTML page with plots."""
from __future__ import annotations

import html
import statistics
from pathlib import Path

from spec_jax.core.records import read_jsonl
from spec_jax.metrics import plots


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(records: list[dict]) -> dict:
    """One row per run: medians over intervals (robust to the warm-up interval)."""
    last = records[-1]
    return {
        "steps": last["step"],
        "final_loss": last["loss"],
        "step_time_s": _median(r["step_time_s"] for r in records),
        "tokens_per_s": _median(r["tokens_per_s"] for r in records),
        "mfu": _median(r["mfu"] for r in records),
        "hfu": _median(r["hfu"] for r in records),
        "memory_peak_bytes": last["memory_peak_bytes"],
        "comm_bytes_per_step": last["comm_bytes_per_step"],
        "data_wait_fraction": _median(r["data_wait_fraction"] for r in records),
        "compile_time_s": last["compile_time_s"],
        "goodput": last["goodput"],
    }


COLUMNS = [  # (key, header, format)
    ("steps", "steps", "{:d}"), ("final_loss", "loss", "{:.4f}"),
    ("step_time_s", "step ms", "{:.1f}", 1e3), ("tokens_per_s", "tok/s", "{:.0f}"),
    ("mfu", "MFU %", "{:.2f}", 100), ("hfu", "HFU %", "{:.2f}", 100),
    ("memory_peak_bytes", "mem MiB", "{:.1f}", 2**-20),
    ("comm_bytes_per_step", "comm MiB/step", "{:.2f}", 2**-20),
    ("data_wait_fraction", "data wait %", "{:.1f}", 100),
    ("compile_time_s", "compile s", "{:.1f}"), ("goodput", "goodput %", "{:.1f}", 100),
]


def _cell(value, fmt, scale=1):
    if value is None:
        return "-"
    return fmt.format(value * scale if scale != 1 else value)


def table(runs: dict[str, dict]) -> str:
    """Plain-text table, one row per run, plus a ratio row against the first run."""
    headers = ["run"] + [c[1] for c in COLUMNS]
    rows = [[name] + [_cell(s[c[0]], c[2], *c[3:]) for c in COLUMNS] for name, s in runs.items()]
    if len(runs) > 1:
        base = next(iter(runs.values()))
        for name, s in list(runs.items())[1:]:
            rows.append([f"{name} / first"] + [
                f"{s[c[0]] / base[c[0]]:.3f}x" if s[c[0]] and base[c[0]] else "-" for c in COLUMNS])
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(len(headers))]
    fmt = lambda r: "  ".join(str(v).rjust(w) for v, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


PLOTS = [  # (file stem, title, y label, series key or callable)
    ("loss", "Loss", "loss", "loss"),
    ("tokens_per_s", "Throughput", "valid tokens / s", "tokens_per_s"),
    ("mfu", "Model FLOPs utilisation", "MFU (%)", lambda r: r["mfu"] and 100 * r["mfu"]),
    ("memory", "Peak memory per device (compiled)", "MiB",
     lambda r: r["memory_peak_bytes"] and r["memory_peak_bytes"] / 2**20),
]


def plot(runs: dict[str, list[dict]], out: Path) -> list[str]:
    """PNG plots comparing the runs; returns the file names written."""
    plt = plots.pyplot()

    written = []
    for stem, title, ylabel, key in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, recs in runs.items():
            get = key if callable(key) else (lambda r, k=key: r[k])
            points = [(r["step"], get(r)) for r in recs if get(r) is not None]
            if points:
                ax.plot(*zip(*points), marker=".", label=name)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        plots.save(fig, out / f"{stem}.png")
        written.append(f"{stem}.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))  # step-time distribution: one box per run
    data = [[r["step_time_s"] * 1e3 for r in recs if r["step_time_s"]] for recs in runs.values()]
    ax.boxplot(data, tick_labels=list(runs))
    ax.set(title="Step time per interval", ylabel="ms")
    plots.save(fig, out / "step_time.png")
    written.append("step_time.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))  # comm bytes by kind, stacked per run
    kinds = sorted({k for recs in runs.values() for k in recs[-1]["comm_bytes_by_kind"]})
    bottom = [0.0] * len(runs)
    for kind in kinds:
        values = [recs[-1]["comm_bytes_by_kind"].get(kind, 0) / 2**20 for recs in runs.values()]
        ax.bar(list(runs), values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title="Communication per step per device (HLO)", ylabel="MiB")
    if kinds:
        ax.legend(fontsize=8)
    plots.save(fig, out / "comm.png")
    written.append("comm.png")
    return written


def write_html(runs: dict[str, list[dict]], summaries: dict[str, dict], images: list[str],
               out: Path) -> Path:
    head = "".join(f"<th>{html.escape(c[1])}</th>" for c in COLUMNS)
    body = "".join(
        "<tr><td>" + html.escape(name) + "</td>"
        + "".join(f"<td>{_cell(s[c[0]], c[2], *c[3:])}</td>" for c in COLUMNS) + "</tr>"
        for name, s in summaries.items())
    first = next(iter(runs.values()))[-1]
    notes = (f"FLOPs convention: {html.escape(str(first['flops_convention']))}; peak: "
             f"{html.escape(str(first['peak_flops_source']))}. Definitions: docs/metrics.md.")
    imgs = "".join(f'<figure><img src="{i}" alt="{i}"></figure>' for i in images)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>trainspec report</title>"
            "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:right}"
            "figure{display:inline-block;margin:4px}</style></head><body>"
            f"<h1>trainspec report</h1><table><tr><th>run</th>{head}</tr>{body}</table>"
            f"<p>{notes}</p>{imgs}</body></html>\n")
    path = out / "index.html"
    path.write_text(page)
    return path


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


def report(paths: list[Path], out: Path) -> tuple[str, Path]:
    runs = {name: read_jsonl(p) for name, p in zip(run_names(paths), paths)}
    summaries = {name: summarize(recs) for name, recs in runs.items()}
    out.mkdir(parents=True, exist_ok=True)
    images = plot(runs, out)
    return table(summaries), write_html(runs, summaries, images, out)
