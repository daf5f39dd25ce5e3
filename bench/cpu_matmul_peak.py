"""Measure this machine's float32 matmul FLOP/s: the CPU entry of the peak table.

How: one jax CPU device (the whole process's thread pool), square float32 matmuls of several
sizes, each timed as the best of R repetitions after a warm-up (best, because on a shared
machine other processes only ever slow a run down); FLOPs = 2 n^3. The largest best rate is the
figure. Run with nothing else of ours running:  python bench/cpu_matmul_peak.py
"""
import os
import platform
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
import jax  # noqa: E402

from spec_jax.tools.plan_check import matmul_peak  # noqa: E402  (the same measurement, one size)


if __name__ == "__main__":
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"jax {jax.__version__}, devices {jax.devices()}")
    rates = {n: matmul_peak(n, repeats=10) for n in (256, 512, 1024, 2048)}
    for n, r in rates.items():
        print(f"  n={n:5d}: {r / 1e9:8.2f} GFLOP/s")
    print(f"peak (largest best rate): {max(rates.values()):.3g} FLOP/s")
