"""Time the compressed gradient exchange of one step on its own: the two-stage exchange of 8
replicas (simulated CPU devices; trainspec.jax.collectives.compression.two_stage_sum) with error
feedback -- by the xla path's jnp kernels and XLA's all-to-all and all-gather, and by the ext
path's xla_ext packed-buffer handlers and ext's all-to-all and all-gather.

The two programs alternate within every round; each round times `--calls` calls of one; the
figure is the median over rounds and the paired ratio ext/xla. The load average is printed
before and after: on a shared machine, read the ratio, not the absolute times.

    python bench/compression_kernels.py [--elements 1048576] [--rounds 7] [--calls 5]
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from trainspec.jax.collectives import compression as jnp_kernels  # noqa: E402
from trainspec.jax.collectives import compression_ext as ext_kernels  # noqa: E402


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def program(impl, mesh, compression, block):
    def body(g, r):
        total, new_r = impl.compressed_sum(g[0], r[0], "data", 8, compression, block)
        return total[None], new_r[None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                                 out_specs=(P("data"), P("data")), check_vma=False))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--elements", type=int, default=1 << 20, help="gradient elements per replica")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--block", type=int, default=256)
    args = p.parse_args()
    mesh = jax.make_mesh((8,), ("data",))
    split = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)
    g = jax.device_put(rng.standard_normal((8, args.elements), np.float32), split)
    r = jax.device_put(rng.standard_normal((8, args.elements), np.float32) * 1e-3, split)
    print(f"{jax.device_count()} devices, {os.cpu_count()} cores, {args.elements} float32 "
          f"elements per replica, int8 block {args.block}; load average {loadavg()}")
    for compression in ("bf16", "int8"):
        runs = {name: program(impl, mesh, compression, args.block)
                for name, impl in (("xla", jnp_kernels), ("ext", ext_kernels))}
        times = {name: [] for name in runs}
        for name, run in runs.items():
            jax.block_until_ready(run(g, r))  # compile and warm up
        for _ in range(args.rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    out = run(g, r)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - start) / args.calls)
        xla, ext = (statistics.median(times[n]) for n in ("xla", "ext"))
        paired = statistics.median(e / x for x, e in zip(times["xla"], times["ext"]))
        print(f"{compression}: xla {xla * 1e3:8.2f} ms, ext {ext * 1e3:8.2f} ms per exchange; "
              f"ext/xla {paired:.3f} (median of paired rounds)")
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
