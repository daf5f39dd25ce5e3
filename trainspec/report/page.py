"""The HTML page of `trainspec report`: one self-contained file (plots inline as base64 PNG, a
small inline stylesheet), headed by the runs and the machine, with the table and its ratio rows,
and the curves marked where a run resumed or saved a checkpoint.

The marks come from fields the trainer writes into step records (docs/metrics.md, section 1):
`resumed_from_step` and `resumed_from_mesh` on the first record after a resume,
`checkpoint_saved: true` on a record after whose step a checkpoint was saved.
"""
from __future__ import annotations

import datetime
import html
import os
import platform

from trainspec.core.errors import UserInputError
from trainspec.report import plots, spec_diff

CURVES = [  # (title, y label, value of a record or None[, its (low, high) band or None])
    ("Loss", "loss", lambda r: r["loss"]),
    ("Eval loss", "held-out loss ([eval])", lambda r: r.get("eval_loss")),
    ("Gradient norm", "global norm, before clipping", lambda r: r.get("grad_norm")),
    ("Gradient noise scale", "B_simple (tokens), 90% interval",
     lambda r: r.get("gns"), lambda r: (r.get("gns_low"), r.get("gns_high"))),
    ("Throughput", "valid tokens / s", lambda r: r["tokens_per_s"]),
    ("Model FLOPs utilisation", "MFU (%)", lambda r: r["mfu"] and 100 * r["mfu"]),
    ("Learning rate", "learning rate", lambda r: r.get("learning_rate")),
    ("Expert load", "tokens per expert, max / mean",
     lambda r: r.get("moe_load_max_over_mean")),
    ("Dropped tokens", "(token, expert) assignments per step",
     lambda r: r.get("moe_dropped_tokens")),
    ("Peak memory per device (compiled)", "MiB",
     lambda r: r["memory_peak_bytes"] and r["memory_peak_bytes"] / 2**20),
]

STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{margin-bottom:.2em} .meta{color:#555;font-size:.9em;margin:.2em 0}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}
th,td{padding:3px 9px;text-align:right;border-bottom:1px solid #ddd}
th{background:#f3f3f3} td:first-child,th:first-child{text-align:left}
tr.ratio td{color:#555;font-style:italic}
figure{display:inline-block;margin:6px;vertical-align:top}
figure img{width:520px} figcaption{font-size:.85em;color:#555}
"""


def resumes(records: list[dict]) -> list[tuple[int, int, str]]:
    """(record step, step resumed from, mesh resumed from) of each resume in a run."""
    return [(r["step"], r["resumed_from_step"], str(r.get("resumed_from_mesh", "?")))
            for r in records if r.get("resumed_from_step") is not None]


def checkpoints(records: list[dict]) -> list[int]:
    """Steps after which the run saved a checkpoint."""
    return [r["step"] for r in records if r.get("checkpoint_saved") is True]


class XAxis:
    """Where a curve's records sit: by step, or by the tokens trained so far (each record's
    steps_in_interval x batch_tokens, summed in order from the first record's start)."""

    def __init__(self, name: str, runs: dict[str, list[dict]]):
        self.name, self.label = name, X_AXES[name]
        self._at = {run: self._positions(name, recs) for run, recs in runs.items()}

    @staticmethod
    def _positions(name: str, records: list[dict]) -> dict[int, float]:
        if name == "step":
            return {r["step"]: r["step"] for r in records}
        first = records[0]
        total, at = (first["step"] - first["steps_in_interval"]) * first["batch_tokens"], {}
        for r in records:
            total += r["steps_in_interval"] * r["batch_tokens"]
            at[r["step"]] = total
        return at

    def of(self, run: str, step: int) -> float:
        """The position of `run`'s step (a record's, or a step a mark names: the nearest
        record at or before it)."""
        at = self._at[run]
        return at.get(step, at[max((s for s in at if s <= step), default=min(at))])


X_AXES = {"step": "step", "tokens": "tokens trained (global_batch x seq_len per step)"}


def x_axis(name: str, runs: dict[str, list[dict]]) -> XAxis:
    """The axis `--x NAME` asks for (every record has batch_tokens: read_jsonl checks it)."""
    if name not in X_AXES:
        raise UserInputError(f"--x {name}: not an axis; one of {', '.join(X_AXES)}")
    return XAxis(name, runs)


def _curve(plt, title, ylabel, value, runs, axis: XAxis | None = None, band=None):
    from matplotlib.lines import Line2D

    axis = axis or XAxis("step", runs)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    handles = []
    for name, recs in runs.items():
        points = [(axis.of(name, r["step"]), value(r)) for r in recs if value(r) is not None]
        if not points:
            continue
        (line,) = ax.plot(*zip(*points), marker=".", label=name)
        handles.append(line)
        spans = [(axis.of(name, r["step"]), *band(r)) for r in recs if band
                 and value(r) is not None and None not in band(r)]
        if spans:
            ax.fill_between(*zip(*spans), color=line.get_color(), alpha=0.2, lw=0)
        for step in checkpoints(recs):
            ax.axvline(axis.of(name, step), color=line.get_color(), ls=":", lw=0.9, alpha=0.7)
        for _, source, mesh in resumes(recs):  # drawn where training continued from
            at = axis.of(name, source)
            ax.axvline(at, color=line.get_color(), ls="--", lw=1.4)
            ax.annotate(f"resumed from {source}\n({mesh})", (at, 1), xycoords=("data", "axes fraction"),
                        xytext=(3, -3), textcoords="offset points", va="top", fontsize=7)
    if not handles:
        plt.close(fig)
        return None
    if any(checkpoints(r) for r in runs.values()):
        handles.append(Line2D([], [], color="grey", ls=":", label="checkpoint saved"))
    if any(resumes(r) for r in runs.values()):
        handles.append(Line2D([], [], color="grey", ls="--", label="resume"))
    ax.set(title=title, xlabel=axis.label, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize=8)
    return fig


def figures(runs: dict[str, list[dict]], axis: XAxis | None = None) -> list[tuple[str, str]]:
    """(caption, PNG data URI) of every plot comparing the runs; a curve no run records is
    left out."""
    plt = plots.pyplot()
    out = []
    for title, ylabel, value, *band in CURVES:
        fig = _curve(plt, title, ylabel, value, runs, axis, *band)
        if fig is not None:
            out.append((f"{title}, per record", plots.data_uri(fig)))

    fig, ax = plt.subplots(figsize=(6, 3.5))  # step-time distribution: one box per run
    data = [[r["step_time_s"] * 1e3 for r in recs if r["step_time_s"]] for recs in runs.values()]
    ax.boxplot(data, tick_labels=list(runs))
    ax.set(title="Step time per interval", ylabel="ms")
    out.append(("Step time per interval (box: quartiles, line: median)", plots.data_uri(fig)))

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
    out.append(("Collective payload per step per device, by kind", plots.data_uri(fig)))
    return out


def machine() -> str:
    """The machine the report is written on (the run records do not name their host)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {platform.system()}"


def _run_line(name: str, path, records: list[dict]) -> str:
    last = records[-1]
    events = []
    if checkpoints(records):
        events.append(f"{len(checkpoints(records))} checkpoints")
    events += [f"resumed at step {s} from step {f} ({m})" for s, f, m in resumes(records)]
    return (f"<li><b>{html.escape(name)}</b> <code>{html.escape(str(path))}</code>: "
            f"{last['step']} steps, {len(records)} records, {last['n_devices']} devices, peak "
            f"{html.escape(str(last['peak_flops_source']))}"
            + (f"; {html.escape('; '.join(events))}" if events else "") + "</li>")


def _table(headers: list[str], rows: list[tuple[bool, list[str]]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        f"<tr{' class=ratio' if ratio else ''}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        + "</tr>" for ratio, cells in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _spec_section(specs: dict[str, dict | None]) -> str:
    """The spec fields that differ between the runs, as a table (spec_diff)."""
    if len(specs) < 2:
        return ""
    rows = spec_diff.differences(specs)
    table = _table(["spec field", *specs], [(False, [f, *v]) for f, v in rows]) if rows else ""
    return ("<h2>Spec fields that differ</h2>" + table
            + "".join(f"<p class=meta>{html.escape(n)}</p>" for n in spec_diff.notes(specs)))


def page(runs: dict[str, list[dict]], paths: list, headers: list[str],
         rows: list[tuple[bool, list[str]]], specs: dict[str, dict | None] | None = None,
         axis: XAxis | None = None) -> str:
    """The whole report. `rows`: (is a ratio row, cells) as `metrics_report.rows` makes them;
    `specs`: each run's spec as dotted fields (spec_diff.run_spec), None where unknown."""
    first = next(iter(runs.values()))[-1]
    figs = "".join(f'<figure><img src="{uri}" alt="{html.escape(cap)}"><figcaption>'
                   f"{html.escape(cap)}</figcaption></figure>" for cap, uri in figures(runs, axis))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>trainspec report: "
        f"{html.escape(', '.join(runs))}</title><style>{STYLE}</style></head><body>"
        f"<h1>trainspec report: {html.escape(', '.join(runs))}</h1>"
        f"<p class=meta>written {when} on {html.escape(machine())}</p>"
        f"<ul class=meta>{''.join(_run_line(n, p, r) for (n, r), p in zip(runs.items(), paths))}</ul>"
        f"{_table(headers, rows)}"
        "<p class=meta>Medians are over the records' intervals (robust to a slow first "
        "interval); the run summary `trainspec train` prints gives means over the whole run. "
        "Ratio rows divide by the first run; tokens/s per device compares runs on different "
        "device counts. FLOPs convention: "
        f"{html.escape(str(first['flops_convention']))}. Definitions: docs/metrics.md. Dotted "
        "lines: checkpoint saved after that step; dashed: resume.</p>"
        f"{_spec_section(specs or {})}{figs}</body></html>\n")
