"""This machine's CPU matmul peak: measured once, cached per machine, the MFU denominator on CPU
for every implementation.

A table value measured on one machine makes MFU on another machine meaningless, so on a CPU the
peak is measured here: float32 square matmuls on all of the process's threads, the best of
several calls after a warm-up (load only ever slows a call down), 2 n^3 FLOPs each; the largest
rate over the sizes is the peak (bench/cpu_matmul_peak.py, the full sweep). It costs about a
second, so it is cached per machine in the user's cache directory (`$TRAINSPEC_CACHE_DIR`, else
`$XDG_CACHE_HOME/trainspec`, else `~/.cache/trainspec`), keyed by CPU model and core count,
written atomically (a temporary file, then a rename).

The key names the machine, not the framework: whichever implementation measures first (with its
own matmul: trainspec.jax.metrics.cpu_peak, trainspec.torch.peak) stores the entry and every
implementation divides by it, so that MFU compares across frameworks as tokens/s does. The entry
says which framework measured it.

`TRAINSPEC_CPU_PEAK=table` skips it and uses the table value (the tests do, to stay cheap and
independent of the machine's load); `=measure` (the default) reads the cache or measures.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from trainspec.core.errors import UserInputError
from trainspec.core.flops import Peak

MODE_ENV = "TRAINSPEC_CPU_PEAK"
CACHE_ENV = "TRAINSPEC_CACHE_DIR"
MODES = ("measure", "table")
SIZES = (512, 1024)  # the sizes that gave the largest rates in bench/cpu_matmul_peak.py


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    return f"{cpu_model()} | {os.cpu_count()} cores"


def cache_file() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trainspec")
    return Path(root) / "cpu_matmul_peak.json"


def best_rate(matmul: Callable[[], None], n: int, repeats: int) -> float:
    """Best FLOP/s of `matmul()` (one n x n by n x n product, finished when it returns) over
    `repeats` calls, after one call to warm up."""
    matmul()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def entry(rates: dict[int, float], measured_with: str) -> dict:
    """One cache entry: the peak over `rates` (FLOP/s by matrix size) and the conditions it was
    measured under."""
    return {"flops": max(rates.values()), "by_size": {str(n): r for n, r in rates.items()},
            "measured_with": measured_with, "load_1min": os.getloadavg()[0],
            "cores": os.cpu_count(),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _read(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # no cache yet
        return {}
    except (OSError, ValueError) as err:
        warnings.warn(f"{path}: unreadable CPU peak cache ({err}); measuring again", stacklevel=3)
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(path: Path, entries: dict) -> str | None:
    """Atomic replace; returns why it could not be written (the run goes on uncached)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:
        return str(err)
    return None


def store(measured: dict) -> str | None:
    """Save `measured` (an `entry`) as this machine's peak; returns why it could not be saved."""
    path = cache_file()
    entries = _read(path)
    entries[machine_key()] = measured
    return _write(path, entries)


def mode() -> str:
    chosen = os.environ.get(MODE_ENV, "measure")
    if chosen not in MODES:
        raise UserInputError(f"{MODE_ENV}: expected one of {', '.join(MODES)}, got {chosen!r}")
    return chosen


def cached() -> dict | None:
    """This machine's cache entry, if there is a usable one."""
    found = _read(cache_file()).get(machine_key())
    return found if isinstance(found, dict) and isinstance(found.get("flops"), (int, float)) else None


def process_peak(measure: Callable[[], dict] | None) -> Peak | None:
    """This machine's measured peak (whole process, float32 FLOP/s), from the cache or, on a
    miss, `measure()`d now and cached; None under `TRAINSPEC_CPU_PEAK=table`, or on a miss when
    `measure` is None (a process of several, whose timings would disturb each other)."""
    if mode() == "table":
        return None
    found, note = cached(), "cached"
    if found is None:
        if measure is None:
            return None
        found = measure()
        failed = store(found)
        note = f"not cached: {failed}" if failed else "measured now"
    by = f", {found['measured_with']}" if found.get("measured_with") else ""
    return Peak(float(found["flops"]),
                f"measured on this machine: {found['flops']:.3g} FLOP/s float32 matmul "
                f"({found['measured_at']}{by}, load {found['load_1min']:.2f} on "
                f"{found['cores']} cores; {note} in {cache_file()})")
