"""Time per step through the torch adapter's step against hand-written torch loops (goal <= 1.05x).

Run as 4 ranks: `trainspec launch --nprocs 4 -- python bench/torch_adapter_overhead.py [ROUNDS]
[ROUND_STEPS]`. Every loop trains the same model (trainspec.torch.model.Transformer of the
default spec), on the same rows of the same batches, with AdamW and global-norm clipping, in
two pairs:
- "adapter (data)": trainspec.torch.train.TorchStep with every rank a data replica (token-weighted
  loss, one packed all-reduce of the gradients, the scalar all-reduce of loss and tokens, the
  global norm, the non-finite decision), against
  "ddp": torch.nn.parallel.DistributedDataParallel, mean loss per rank, DDP's bucketed gradient
  averaging, torch.nn.utils.clip_grad_norm_, optimizer.step;
- "adapter (fsdp)": the same step with every rank an fsdp shard (FSDP2 `fully_shard` of each
  block and the root, summing reduce-scatters, the norm over the shards), against
  "fully_shard": plain FSDP2 as its documentation writes it (each block and the root, FSDP2's
  averaging), mean loss per rank, clip_grad_norm_ on the sharded gradients, optimizer.step.
Rounds alternate all four loops so that machine drift hits each; rank 0 prints median per-step
times, each pair's ratio and the load average.
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.model import Transformer, next_token_loss
from trainspec.torch.train import TorchStep
from trainspec.core.spec import default_spec, load_spec
from trainspec.core.data import ByteBatches

NO_ACCUMULATION = ["batch.micro_batch=32"]  # neither DDP nor the plain FSDP2 loop accumulates
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


def main(rounds: int = 5, round_steps: int = 10) -> None:
    adapter = TorchRuntime()
    adapter.join()
    specs = {name: load_spec(default_spec(), NO_ACCUMULATION + sets) for name, sets in LAYOUTS.items()}
    steps = {name: TorchStep(spec, adapter.build_mesh(spec), 2 * rounds * round_steps, adapter.device)
             for name, spec in specs.items()}
    spec = specs["data"]
    rows = steps["data"].rows()
    assert rows == steps["fsdp"].rows()  # both layouts split the batch over all ranks alike
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    batches = [{k: v[rows] for k, v in data.batch(i).items()} for i in range(round_steps)]

    loops = {"adapter (data)": steps["data"], "ddp": plain_loop(ddp_model(spec)),
             "adapter (fsdp)": steps["fsdp"], "fully_shard": plain_loop(fully_shard_model(spec))}
    pairs = [("adapter (data)", "ddp"), ("adapter (fsdp)", "fully_shard")]
    times = {name: [] for name in loops}
    for name, fn in loops.items():  # warm-up
        fn(batches[0])
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
        print(f"{adapter.process_count} ranks, default model, global batch "
              f"{spec.batch.global_batch} x {spec.batch.seq_len}, {rounds} rounds x {round_steps} steps")
        for name, value in med.items():
            print(f"  {name:15s} {value * 1e3:8.1f} ms/step")
        for ours, theirs in pairs:
            print(f"  {ours} / {theirs} = {med[ours] / med[theirs]:.3f}x")
        print(f"  load average {' '.join(load)}")
    adapter.leave()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
