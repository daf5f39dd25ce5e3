"""Where the torch adapter's step spends its host operations, against DDP + clip_grad_norm_:
the profile behind bench/torch_adapter_overhead.py's small-model line.

Run as 4 ranks: `trainspec launch --nprocs 4 -- python bench/torch_step_profile.py [STEPS]
[MODEL]` (MODEL "small" or "default", as in torch_adapter_overhead.py). Both loops train the
same model on the same rows (torch_adapter_overhead.py's "adapter (data)" and "ddp"); each runs
a few steps, then STEPS steps under torch.profiler. Rank 0 prints, per step, the operations
called from the step itself (not from inside another operation: a multi-tensor or fused
operation counts once) by name, with their count and CPU time including what they call, the
names whose counts differ first; then the totals, every operation's self CPU time, and the load.
The counts do not depend on the machine's load; the times do (compare them within one run)."""
import collections
import sys

import torch
import torch.distributed as dist

from torch_adapter_overhead import MODELS, adapter_loop, ddp_model, plain_loop
from trainspec.core.data import ByteBatches
from trainspec.core.spec import default_spec, load_spec
from trainspec.torch.runtime import TorchRuntime

STEP = "bench step"


def profiled(fn, batches) -> tuple[dict[str, list[float]], float]:
    """{name: [count, CPU us]} of the operations each step calls itself, per step, and the
    self CPU time (us) of every operation per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for batch in batches:
            with torch.profiler.record_function(STEP):
                fn(batch)
    top: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    self_us = 0.0
    for event in prof.events():
        if event.name != STEP:
            self_us += event.self_cpu_time_total
        if event.cpu_parent is not None and event.cpu_parent.name == STEP:
            top[event.name][0] += 1
            top[event.name][1] += event.cpu_time_total
    n = len(batches)
    return {name: [count / n, us / n] for name, (count, us) in top.items()}, self_us / n


def main(steps: int = 10, model: str = "small") -> None:
    adapter = TorchRuntime()
    adapter.join()
    spec = load_spec(default_spec(), MODELS[model])
    step, adapter_step = adapter_loop(spec, adapter, 1000)
    rows = step.rows()
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    batches = [{k: v[rows] for k, v in data.batch(i).items()} for i in range(steps)]
    loops = {"adapter": adapter_step, "ddp": plain_loop(ddp_model(spec))}
    results = {}
    for name, fn in loops.items():
        for batch in batches[:3]:  # warm-up (the first update is decided on the host)
            fn(batch)
        dist.barrier()
        results[name] = profiled(fn, batches)
    if adapter.is_writer():
        (ours, our_self), (ddp, ddp_self) = results["adapter"], results["ddp"]
        print(f"{adapter.process_count} ranks, {model} model, {steps} steps each; per step:")
        print(f"  {'operation called by the step':56s} {'adapter':>8s} {'us':>8s} "
              f"{'ddp':>6s} {'us':>8s}")
        names = sorted(set(ours) | set(ddp), key=lambda k: (
            -abs(ours.get(k, [0])[0] - ddp.get(k, [0])[0]), -ours.get(k, [0, 0])[1]))
        for key in names:
            a, b = ours.get(key, [0, 0.0]), ddp.get(key, [0, 0.0])
            print(f"  {key[:56]:56s} {a[0]:8.1f} {a[1]:8.0f} {b[0]:6.1f} {b[1]:8.0f}")
        print(f"  operations called by the step: adapter {sum(v[0] for v in ours.values()):.0f}, "
              f"ddp {sum(v[0] for v in ddp.values()):.0f} (DDP's forward is one of its own)")
        print(f"  self CPU of every operation: adapter {our_self / 1e3:.2f} ms, "
              f"ddp {ddp_self / 1e3:.2f} ms")
        with open("/proc/loadavg") as f:
            print(f"  load average {' '.join(f.read().split()[:3])}", flush=True)
    adapter.leave()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]), *sys.argv[2:3])
