"""This machine's CPU matmul peak: measured once, cached per machine, the MFU denominator on CPU.

A table value measured on one machine makes MFU on another machine meaningless, so on a CPU the
peak is measured here: float32 square matmuls on one jax device (the process's whole thread
pool), the best of several calls after a warm-up (load only ever slows a call down), 2 n^3
FLOPs each; the largest rate over the sizes is the peak (bench/cpu_matmul_peak.py, the full
sweep). It costs about a second, so it is cached per machine in the user's cache directory
(`$TRAINSPEC_CACHE_DIR`, else `$XDG_CACHE_HOME/trainspec`, else `~/.cache/trainspec`), keyed by
CPU model, core count and jax version, written atomically (a temporary file, then a rename).

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
from pathlib import Path

import jax
import jax.numpy as jnp

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
    return f"{cpu_model()} | {os.cpu_count()} cores | jax {jax.__version__}"


def cache_file() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trainspec")
    return Path(root) / "cpu_matmul_peak.json"


def matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    """Best float32 matmul FLOP/s of the process on one device, over `repeats` calls."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measure(sizes=SIZES, repeats: int = 5) -> dict:
    """One cache entry: the peak and the conditions it was measured under."""
    rates = {n: matmul_peak(n, repeats) for n in sizes}
    return {"flops": max(rates.values()), "by_size": {str(n): r for n, r in rates.items()},
            "load_1min": os.getloadavg()[0], "cores": os.cpu_count(),
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


def store(entry: dict) -> str | None:
    """Save `entry` as this machine's peak; returns why it could not be saved, else None."""
    path = cache_file()
    entries = _read(path)
    entries[machine_key()] = entry
    return _write(path, entries)


def process_peak() -> Peak | None:
    """This machine's measured peak (whole process, float32 FLOP/s), from the cache or measured
    now and cached; None under `TRAINSPEC_CPU_PEAK=table`, or when several processes would
    measure at once on a cache miss (their timings would disturb each other)."""
    mode = os.environ.get(MODE_ENV, "measure")
    if mode not in MODES:
        raise UserInputError(f"{MODE_ENV}: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode == "table":
        return None
    path = cache_file()
    entry, note = _read(path).get(machine_key()), "cached"
    if not isinstance(entry, dict) or not isinstance(entry.get("flops"), (int, float)):
        if jax.process_count() > 1:
            return None
        entry = measure()
        failed = store(entry)
        note = f"not cached: {failed}" if failed else "measured now"
    return Peak(float(entry["flops"]),
                f"measured on this machine: {entry['flops']:.3g} FLOP/s float32 matmul "
                f"({entry['measured_at']}, load {entry['load_1min']:.2f} on {entry['cores']} "
                f"cores; {note} in {path})")
