"""Presenting collective benchmark rows: the nccl-tests-style table, JSON rows, the busbw plot."""
from __future__ import annotations

import dataclasses
import os

import jax

from trainspec.core.topology import allocator_settings, transparent_huge_pages
from trainspec.report import plots
from trainspec.jax.tools.collectives_bench import Row, variant_name, variants

JSON_KEYS = ("op", "dtype", "redop", "size_bytes", "count", "backend", "time_us", "algbw_gbps",
             "busbw_gbps", "wrong")


def as_dict(row: Row) -> dict:
    d = dataclasses.asdict(row)
    extra = ("group_size",) if row.group_size is not None else ()  # only across processes
    extra += ("in_place",) if row.in_place else ()  # only in place: older readers see no change
    return {k: d[k] for k in JSON_KEYS + extra}


def machine_load_line(load_1min: float | None = None, cores: int | None = None) -> str:
    """The machine's load next to the timings: taken on a busy machine they are not comparable."""
    load_1min = os.getloadavg()[0] if load_1min is None else load_1min
    cores = (os.cpu_count() or 1) if cores is None else cores
    line = f"# load average {load_1min:.2f} (1 min) on {cores} cores"
    if load_1min > cores:
        line += ("\n# WARNING: load exceeds the core count; other work shares the machine and "
                 "these timings are not comparable")
    return line


def allocator_line(environ=None, huge_pages: str | None = None) -> str:
    """glibc's malloc settings taken from the environment and the kernel's huge page mode: with
    large outputs they move both backends' times by up to 3x (docs/results.md, "Quiet and
    loaded side by side")."""
    settings = allocator_settings(os.environ if environ is None else environ)
    huge_pages = transparent_huge_pages() if huge_pages is None else huge_pages
    return f"# glibc malloc: {settings}; transparent huge pages: {huge_pages}"


class Table:
    """Streams one line per (op, dtype, redop, size) once every backend has reported it."""

    def __init__(self, backends, in_place=False):
        # One column per backend, and with `in_place` per backend in place ("ext in-place").
        forms = variants(backends, in_place)
        self.backends = [variant_name(*form) for form in forms]
        # Each other column's time over xla's placed alike (in place over in place), measured
        # side by side: column -> (its ratio's label, the xla column it is divided by).
        self.ratios = {variant_name(b, p): (f"{b[:4]}{'-ip' * p}/xla{'-ip' * p}",
                                            variant_name("xla", p))
                       for b, p in forms if b != "xla" and ("xla", p) in forms}
        self._pending: dict[tuple, dict[str, Row]] = {}
        self._op = None

    def preamble(self) -> str:
        text = (f"# trainspec bench collectives: {jax.device_count()} {jax.devices()[0].platform} "
                f"devices, jax {jax.__version__}; size = bytes per device (nccl-tests); "
                f"time = median (us); algbw, busbw in GB/s (1e9 B)")
        text += "\n" + machine_load_line() + "\n" + allocator_line()
        if jax.process_count() > 1:
            text += (f"\n# {jax.process_count()} processes x {jax.local_device_count()} devices: "
                     f"ext within each process (group of {jax.local_device_count()}), the others "
                     f"across all {jax.device_count()} devices")
        return text

    def footer(self, rows: list[Row]) -> list[str]:
        """nccl-tests' closing line, per backend: the mean busbw over every row measured."""
        lines = []
        for backend in self.backends:
            bws = [r.busbw_gbps for r in rows if r.variant == backend]
            if bws:
                lines.append(f"# Avg bus bandwidth    : {sum(bws) / len(bws):.3f} GB/s ({backend})")
        return lines

    def header(self) -> list[str]:
        left = f"#{'size':>11} {'count':>10} {'type':>9} {'redop':>6} {'root':>5}"
        per = "".join(f" |{b + ' time':>{self._width(b)}} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
                      for b in self.backends)
        return [left + per + "".join(f" | {label:>8}" for label, _ in self.ratios.values())]

    @staticmethod
    def _width(column: str) -> int:  # of the time column
        return max(12, len(column) + 5)

    def add(self, row: Row) -> list[str]:
        key = (row.op, row.dtype, row.redop, row.size_bytes)
        done = self._pending.setdefault(key, {})
        done[row.variant] = row
        if len(done) < len(self.backends):
            return []
        del self._pending[key]
        lines = []
        if row.op != self._op:
            self._op = row.op
            lines += ["", f"# {row.op}"] + self.header()
        lines.append(self.line(done))
        return lines

    def line(self, by_backend: dict[str, Row]) -> str:
        r = next(iter(by_backend.values()))
        text = f" {r.size_bytes:>11} {r.count:>10} {r.dtype:>9} {r.redop:>6} {r.root:>5}"
        for b in self.backends:
            x = by_backend[b]
            text += (f" |{x.time_us:>{self._width(b)}.1f} {x.algbw_gbps:>7.3f} "
                     f"{x.busbw_gbps:>7.3f} {x.wrong:>6}")
        for c, (label, base) in self.ratios.items():
            ratio = by_backend[c].time_us / by_backend[base].time_us
            text += f" | {ratio:>{max(8, len(label))}.2f}"
        return text


def plot(rows: list[Row], path) -> None:
    """PNG of `figure(rows)`, drawn without a display (Agg, chosen before the figure exists)."""
    plots.pyplot()
    plots.save(figure(rows), path)


def figure(rows: list[Row]):
    """busbw against size, one panel per op, one line per backend (and dtype), on the current
    matplotlib backend (a notebook's inline one, say)."""
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in rows))
    cols = min(3, len(ops))  # wrap into rows of three panels so six ops stay readable
    rows_n = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.5 * cols, 3.6 * rows_n), squeeze=False)
    for ax in axes.flat[len(ops):]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, ops):
        lines = dict.fromkeys((r.variant, r.dtype, r.redop) for r in rows if r.op == op)
        for backend, dtype, redop in lines:
            pts = sorted((r.size_bytes, r.busbw_gbps) for r in rows
                         if (r.op, r.variant, r.dtype, r.redop) == (op, backend, dtype, redop))
            ax.plot(*zip(*pts), marker="o", label=f"{backend} {dtype}")
        sizes = sorted({r.size_bytes for r in rows if r.op == op})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [_human(s) for s in sizes], rotation=45)
        ax.minorticks_off()
        ax.set(xlabel="size per device (bytes)", ylabel="busbw (GB/s)", title=op)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def _human(size: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)
