"""Measure this machine's float32 matmul FLOP/s: the CPU entry of the peak table, and (with
--save) the per-machine cache that MFU on a CPU divides by (trainspec/core/cpu_peak.py).

How: one jax CPU device (the whole process's thread pool), square float32 matmuls of several
sizes, each timed as the best of R repetitions after a warm-up (best, because on a shared
machine other processes only ever slow a run down); FLOPs = 2 n^3. The largest best rate is the
figure. Run with nothing else of ours running:  python bench/cpu_matmul_peak.py [--save]
"""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
import jax  # noqa: E402

from trainspec.jax.metrics import cpu_peak  # noqa: E402  (the same measurement as the cache's)


if __name__ == "__main__":
    print(f"machine: {cpu_peak.machine_key()}, devices {jax.devices()}, "
          f"load {os.getloadavg()[0]:.2f} (1 min)")
    entry = cpu_peak.measure(sizes=(256, 512, 1024, 2048), repeats=10)
    for n, r in entry["by_size"].items():
        print(f"  n={int(n):5d}: {r / 1e9:8.2f} GFLOP/s")
    print(f"peak (largest best rate): {entry['flops']:.3g} FLOP/s")
    if "--save" in sys.argv[1:]:
        failed = cpu_peak.store(entry)
        print(f"not saved: {failed}" if failed else f"saved as this machine's peak in {cpu_peak.cache_file()}")
