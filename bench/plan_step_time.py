"""The planner's step time against measured, on every validation layout (docs/plan.md).

Calibrates the CPU profile in this process (matmul peak, collective alpha-beta, memory
bandwidth, then the step-time parameters from the `TIME_CALIBRATION` steps: the 1-device step at 8 and 24 rows
and the 8-device tensor layout), then compiles each layout that `tests/test_plan.py`
validates (27: 1-8 devices and the 2 x 4 dcn row) and compares the predicted step time with
the median of --steps timed steps. Prints one row per layout with the 1-minute load average
at that moment, the load before and after, the calibration steps re-timed at the end against
their fitted prediction (far from 1: the load changed during the run), and how many rows are
within 30%. No load correction: run it on a quiet machine (about 80 s there).
    python bench/plan_step_time.py [--steps N] [--tolerance 0.3]
"""
import argparse
import functools
import math
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

from spec_jax.core.plan.hardware import load_profile  # noqa: E402
from spec_jax.tools.plan_check import (TIME_CALIBRATION, calibrate_cpu, calibrate_time,  # noqa: E402
                                       compile_layout, interleaved_step_times, predict_for,
                                       step_time, validation_layouts, validation_spec)


def loadavg() -> float:
    return os.getloadavg()[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=11, help="timed steps per layout (median)")
    p.add_argument("--tolerance", type=float, default=0.3)
    args = p.parse_args()
    assert jax.device_count() >= 8, "needs 8 devices (XLA_FLAGS host platform device count)"
    start, load_before = time.perf_counter(), loadavg()

    @functools.lru_cache(maxsize=None)
    def runner(data, fsdp, tensor, dcn, rows):
        return compile_layout(validation_spec(data, fsdp, tensor, dcn, rows), data * fsdp * tensor)[0]

    profile = calibrate_time(calibrate_cpu(load_profile("cpu")), runner)
    print(f"calibrated: peak {profile.peak('float32'):.3g} FLOP/s x achievable "
          f"{profile.achievable_fraction:.3f}, per-step overhead {profile.program_overhead_s * 1e3:.2f} ms, "
          f"ICI alpha {profile.ici.alpha_s * 1e6:.0f} us + {profile.ici.alpha_per_peer_s * 1e6:.0f} us "
          f"per peer, {profile.ici.bandwidth_Bps / 1e9:.2f} GB/s; memory {profile.memory_bandwidth_Bps / 1e9:.1f} GB/s")
    print(f"{'data':>4} {'fsdp':>4} {'tensor':>6} {'dcn':>3}  {'predicted ms':>12} {'measured ms':>11} "
          f"{'error':>7}  {'compute':>7} {'overhead':>8} {'update':>6} {'comm':>6}  loadavg")
    within, rows, excluded = 0, 0, 0
    for layout in validation_layouts():
        d, f, t, dcn = layout
        pred = predict_for(validation_spec(d, f, t, dcn), d * f * t, profile)
        seconds, load = step_time(runner(d, f, t, dcn, 8), args.steps), loadavg()
        err = pred.step_time_s / seconds - 1
        calibration = (*layout, 8) in TIME_CALIBRATION
        excluded += calibration
        if not calibration:
            rows += 1
            within += abs(err) <= args.tolerance
        print(f"{d:>4} {f:>4} {t:>6} {dcn:>3}  {pred.step_time_s * 1e3:>12.1f} {seconds * 1e3:>11.1f} "
              f"{err:>+7.0%}  {pred.compute_s * 1e3:>7.1f} {pred.overhead_s * 1e3:>8.1f} {pred.update_s * 1e3:>6.1f} "
              f"{pred.comm_s['exposed'] * 1e3:>6.1f}  {load:.1f}{'  (calibration)' if calibration else ''}")
    # the calibration steps again: had the machine's load changed since calibration, they
    # would no longer match the prediction fitted to them
    again = interleaved_step_times([runner(*c) for c in TIME_CALIBRATION])
    print("calibration steps re-timed at the end, measured / predicted: " + ", ".join(
        f"{c[:4]} {c[4]} rows {s / predict_for(validation_spec(*c), math.prod(c[:3]), profile).step_time_s:.2f}"
        for c, s in zip(TIME_CALIBRATION, again)))
    print(f"within {args.tolerance:.0%}: {within} of {rows} validated layouts "
          f"({excluded} calibration layouts excluded); load {load_before:.1f} before, "
          f"{loadavg():.1f} after; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
