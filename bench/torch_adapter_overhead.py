"""Time per step through the torch adapter's step against a hand-written DDP loop (goal <= 1.05x).

Run as 4 ranks: `trainspec launch --nprocs 4 -- python bench/torch_adapter_overhead.py [ROUNDS]
[ROUND_STEPS]`. Both loops train the same model (trainspec.torch.model.Transformer of
the default spec), on the same rows of the same batches, with AdamW and global-norm clipping:
- "adapter": trainspec.torch.step.TorchStep (data layout: token-weighted loss, one
  packed all-reduce of the gradients, the scalar all-reduce of loss and tokens, the global norm,
  the non-finite decision);
- "ddp": torch.nn.parallel.DistributedDataParallel, mean loss per rank, DDP's bucketed
  gradient averaging, torch.nn.utils.clip_grad_norm_, optimizer.step.
Rounds alternate so that machine drift hits both; rank 0 prints median per-step times, their
ratio and the load average.
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainspec.torch.adapter import TorchAdapter
from trainspec.torch.model import Transformer, next_token_loss
from trainspec.torch.step import TorchStep
from trainspec.core.spec import default_spec, load_spec
from trainspec.core.data import ByteBatches


def main(rounds: int = 5, round_steps: int = 10) -> None:
    adapter = TorchAdapter()
    adapter.join()
    spec = load_spec(default_spec(), ["batch.micro_batch=32"])  # no accumulation: DDP has none
    step = TorchStep(spec, adapter.build_mesh(spec), 2 * rounds * round_steps, adapter.device)
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    rows = step.rows()
    batches = [{k: v[rows] for k, v in data.batch(i).items()} for i in range(round_steps)]

    model = Transformer(spec.model)
    model.init_weights(spec.seed)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.0)

    def ddp_step(batch):
        tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
        optimizer.zero_grad()
        loss_sum, tokens = next_token_loss(ddp(tensors["inputs"]), tensors["targets"], tensors["mask"])
        (loss_sum / tokens).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()

    loops = {"adapter": step, "ddp": ddp_step}
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
            print(f"  {name:8s} {value * 1e3:8.1f} ms/step")
        print(f"  adapter / ddp = {med['adapter'] / med['ddp']:.3f}x   (load average {' '.join(load)})")
    adapter.leave()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
