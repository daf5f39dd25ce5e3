"""Time per step through the torch adapter's step against hand-written torch loops (goal <= 1.05x).

Run as 4 ranks: `trainspec launch --nprocs 4 -- python bench/torch_adapter_overhead.py [ROUNDS]
[ROUND_STEPS] [MODELS]`, MODELS a comma-separated list of "small" (131K parameters, global
batch 16 x 32: a step of a few ms, where a fixed cost per step shows) and "default" (the
default spec's model and batch), both by default. For each model, every loop trains the same
model (trainspec.torch.models.transformer.Transformer), on the same rows of the same batches,
with AdamW and global-norm clipping, in two pairs:
- "adapter (data)": the run loop's step (trainspec.torch.engine.TorchEngine over
  trainspec.torch.train.TorchStep, an unrecorded step: nothing read on the host) with every
  rank a data replica (token-weighted loss, the gradients all-reduced in buckets while the
  backward runs, the loss and token sums riding in the last bucket, the global norm, the
  non-finite decision on the device), against
  "ddp": torch.nn.parallel.DistributedDataParallel, mean loss per rank, DDP's bucketed gradient
  averaging, torch.nn.utils.clip_grad_norm_, optimizer.step;
- "adapter (fsdp)": the same step with every rank an fsdp shard (FSDP2 `fully_shard` of each
  block and the root, summing reduce-scatters, the norm over the shards), against
  "fully_shard": plain FSDP2 as its documentation writes it (each block and the root, FSDP2's
  averaging), mean loss per rank, clip_grad_norm_ on the sharded gradients, optimizer.step.
Rounds alternate all four loops so that machine drift hits each; rank 0 prints median per-step
times, each pair's ratio with its range over the rounds (each round's ratio), and the load
average.
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainspec.torch.engine import TorchEngine
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.models.transformer import Transformer, next_token_loss
from trainspec.torch.train import TorchStep
from trainspec.core.spec import default_spec, load_spec
from trainspec.core.data import ByteBatches

# neither DDP nor the plain FSDP2 loop accumulates
MODELS = {"small": ["model.d_model=64", "model.d_ff=256", "model.n_heads=4", "batch.seq_len=32",
                    "batch.global_batch=16", "batch.micro_batch=16"],
          "default": ["batch.micro_batch=32"]}
LAYOUTS = {"data": [], "fsdp": ["mesh.axes.data.size=1", "mesh.axes.fsdp.size=-1"]}


def plain_loop(model: torch.nn.Module):
    """A hand-written step over `model` (already wrapped for its parallelism)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

    def step(batch):
        tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
        optimizer.zero_grad()
        loss_sum, tokens = next_token_loss(model(tensors["inputs"]), tensors["targets"], tensors["mask"])
        (loss_sum / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def ddp_model(spec) -> torch.nn.Module:
    model = Transformer(spec.model)
    model.init_weights(spec.seed)
    return DistributedDataParallel(model)


def fully_shard_model(spec) -> torch.nn.Module:
    model = Transformer(spec.model)
    model.init_weights(spec.seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def adapter_loop(spec, adapter: TorchRuntime, total_steps: int):
    """The run loop's step of `spec` on this rank, as `trainspec train --framework torch` runs
    a step it does not record."""
    step = TorchStep(spec, adapter.build_mesh(spec), total_steps, adapter.device)
    engine = TorchEngine(step, adapter)
    return step, lambda batch: engine(step, batch)


def time_model(adapter: TorchRuntime, model: str, rounds: int, round_steps: int) -> None:
    specs = {name: load_spec(default_spec(), MODELS[model] + sets)
             for name, sets in LAYOUTS.items()}
    built = {name: adapter_loop(spec, adapter, 2 * rounds * round_steps)
             for name, spec in specs.items()}
    spec = specs["data"]
    rows = built["data"][0].rows()
    assert rows == built["fsdp"][0].rows()  # both layouts split the batch over all ranks alike
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    batches = [{k: v[rows] for k, v in data.batch(i).items()} for i in range(round_steps)]

    loops = {"adapter (data)": built["data"][1], "ddp": plain_loop(ddp_model(spec)),
             "adapter (fsdp)": built["fsdp"][1], "fully_shard": plain_loop(fully_shard_model(spec))}
    pairs = [("adapter (data)", "ddp"), ("adapter (fsdp)", "fully_shard")]
    times = {name: [] for name in loops}
    for name, fn in loops.items():  # warm-up (the first update is decided on the host)
        for batch in batches[:2]:
            fn(batch)
    for _ in range(rounds):
        for name, fn in loops.items():
            dist.barrier()
            t = time.perf_counter()
            for batch in batches:
                fn(batch)
            dist.barrier()
            times[name].append((time.perf_counter() - t) / round_steps)
    if adapter.is_writer():
        med = {name: statistics.median(v) for name, v in times.items()}
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        params = sum(p.numel() for p in Transformer(spec.model).parameters())
        print(f"{adapter.process_count} ranks, {model} model ({params} parameters), global batch "
              f"{spec.batch.global_batch} x {spec.batch.seq_len}, {rounds} rounds x "
              f"{round_steps} steps")
        for name, value in med.items():
            print(f"  {name:15s} {value * 1e3:8.1f} ms/step")
        for ours, theirs in pairs:
            each = [a / b for a, b in zip(times[ours], times[theirs])]
            print(f"  {ours} / {theirs} = {med[ours] / med[theirs]:.3f}x "
                  f"(rounds {min(each):.3f}-{max(each):.3f})")
        print(f"  load average {' '.join(load)}", flush=True)


def main(rounds: int = 5, round_steps: int = 10, models: str = "small,default") -> None:
    adapter = TorchRuntime()
    adapter.join()
    for model in models.split(","):
        time_model(adapter, model, rounds, round_steps)
    adapter.leave()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]), *sys.argv[3:4])
