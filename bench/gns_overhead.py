"""Step time of the default job with the gradient noise scale measured against without it.

Two compiled steps of the same job (8 simulated CPU devices), `metrics.gns = true` and
`false`, run in alternating rounds so that machine drift hits both; each round times
ROUND_STEPS steps ended by one block_until_ready. The ratio is the median over rounds of
on/off of adjacent rounds (drift cancels pairwise). XLA's cost analysis of both compiled steps
adds a load-independent count: extra FLOPs and bytes accessed per step. With
`--micro 32` (one micro-batch), turning GNS on also moves the step from XLA's implicit gradient
reduction to the explicit per-replica one (docs/advice.md), so that ratio includes the move.
Prints the load average before and after: this machine is shared.
    python bench/gns_overhead.py [--rounds R] [--round-steps N] [--micro M]
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402

from trainspec.jax import default_spec, load_spec  # noqa: E402
from trainspec.jax.train import build_job  # noqa: E402


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--round-steps", type=int, default=10)
    p.add_argument("--micro", type=int, default=None, help="batch.micro_batch (default: spec's)")
    args = p.parse_args()
    extra = [f"batch.micro_batch={args.micro}"] if args.micro else []
    jobs, states = {}, {}
    for gns in (False, True):
        spec = load_spec(default_spec(), [f"metrics.gns={str(gns).lower()}", *extra])
        jobs[gns] = build_job(spec, total_steps=10**6)
        states[gns] = jobs[gns].state
    batches = [jobs[False].data.batch(i) for i in range(args.round_steps)]
    batches = [jobs[False].step.shard_batch(b) for b in batches]  # input off the clock

    def run(gns: bool) -> float:
        t = time.perf_counter()
        for batch in batches:
            states[gns], metrics = jobs[gns].step(states[gns], batch)
        jax.block_until_ready(states[gns])
        return (time.perf_counter() - t) / args.round_steps

    cost = {g: jobs[g].step.lower(states[g], batches[0]).compile().cost_analysis() for g in jobs}
    run(False), run(True)  # compile and warm up
    before = loadavg()
    times = {False: [], True: []}
    for _ in range(args.rounds):
        for gns in (False, True):
            times[gns].append(run(gns))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    spec = jobs[True].spec
    print(f"devices {jax.device_count()} ({jax.devices()[0].platform}), {os.cpu_count()} cores, "
          f"default job, micro_batch {spec.batch.micro} of {spec.batch.global_batch}, "
          f"{args.rounds} rounds x {args.round_steps} steps; load average {before} -> {loadavg()}")
    print(f"gns off: {off * 1e3:8.2f} ms/step  (rounds: {[round(t * 1e3, 1) for t in times[False]]})")
    print(f"gns on:  {on * 1e3:8.2f} ms/step  (rounds: {[round(t * 1e3, 1) for t in times[True]]})")
    paired = statistics.median(b / a for a, b in zip(times[False], times[True]))
    print(f"ratio: {paired:.4f}x median of paired rounds, {on / off:.4f}x of medians "
          f"(goal <= 1.01x); source {jobs[True].step.gns_source}")
    for key in ("flops", "bytes accessed"):
        print(f"XLA cost analysis, {key} per step: off {cost[False][key]:.4g}, on "
              f"{cost[True][key]:.4g} ({cost[True][key] / cost[False][key]:.4f}x)")


if __name__ == "__main__":
    main()
