"""Cost of replica fingerprints relative to training, measured in the same process.

For each layout: the mean time of a training step of the default job, and the mean time of a
full replica check (on-device fingerprints of every shard of params + optimizer state, the
small result copied to the host, copies compared). The overhead of checking every N steps is
check / (N * step). Run: python bench/fingerprint_overhead.py [--steps 20] [--every 100]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from trainspec.jax.health.replicas import ReplicaFingerprints  # noqa: E402
from trainspec.core.spec import default_spec, load_spec  # noqa: E402
from trainspec.jax.train import build_job  # noqa: E402

LAYOUTS = {"data=8": [], "data=4 x fsdp=2": ["mesh.axes.fsdp.size=2"]}


def _mean_time(fn, n: int) -> float:
    fn()  # warm-up (compilation)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def measure(overrides: list[str], steps: int) -> tuple[float, float, int]:
    spec = load_spec(default_spec(), overrides)
    job = build_job(spec)
    state = {"s": job.state}
    batches = [job.step.shard_batch(job.data.batch(i)) for i in range(steps + 1)]
    it = iter(range(10**9))

    def train_step():
        state["s"], m = job.step(state["s"], batches[next(it) % len(batches)])
        jax.block_until_ready(m["loss"])

    t_step = _mean_time(train_step, steps)
    checker = ReplicaFingerprints(job.step.mesh, spec.mesh.axes_with_role("data"))
    t_check = _mean_time(lambda: checker.check(state["s"]), steps)
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(state["s"]))
    return t_step, t_check, n_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    print(f"{jax.device_count()} {jax.devices()[0].platform} devices; default job; "
          f"check every {args.every} steps")
    print(f"{'layout':18s} {'state MB':>9s} {'step ms':>9s} {'check ms':>9s} {'overhead':>9s}")
    for name, overrides in LAYOUTS.items():
        t_step, t_check, n_bytes = measure(overrides, args.steps)
        overhead = t_check / (args.every * t_step)
        print(f"{name:18s} {n_bytes / 1e6:9.2f} {t_step * 1e3:9.2f} {t_check * 1e3:9.2f} "
              f"{100 * overhead:8.3f}%")


if __name__ == "__main__":
    main()
