"""One rank of test_torch_pipeline_layouts.py, under `trainspec launch --nprocs 8 -- python
torch_pipeline_layouts_worker.py JOB.json`: every layout of JOB["reference"] (the reference
model, trainspec.torch.train.TorchStep) and of JOB["user"] (the user's model below, through
`trainspec.torch.wrap`) trained for JOB["steps"] steps from the same seeded parameters, one
after the other in the one process group (8 ranks start once). Rank 0 writes
{family: {layout: {"loss": [...], "grad_norm": [...], "evaluated": [loss]}}} to JOB["out"].

The user's model is a stack of identical blocks (a linear embedding, residual tanh blocks in an
nn.ModuleDict, a linear head) that names its pipeline split points as docs/wrapping.md
("Pipeline") says: `blocks`, `keep_stage(layers, first, last)` and a PipelineIO."""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

import trainspec.torch
from trainspec.core.data import ByteBatches
from trainspec.core.spec import load_spec
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.train import TorchStep

FEATURES, WIDTH, BLOCKS = 8, 16, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.dense(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(BLOCKS)})
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = x if self.embed is None else self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head(x)[..., 0]

    def keep_stage(self, layers: range, first: bool, last: bool) -> None:
        for name in [n for n in self.blocks if int(n) not in layers]:
            del self.blocks[name]
        if not first:
            self.embed = None
        if not last:
            self.head = None


def squared_error(prediction, y):
    return ((prediction - y) ** 2).sum()


def user_loss(model, batch):
    return squared_error(model(batch["x"]), batch["y"]), batch["y"].numel()


USER_PIPELINE = trainspec.torch.PipelineIO(
    inputs=lambda batch: batch["x"], target=lambda batch: batch["y"], loss=squared_error,
    tokens=lambda batch: batch["y"].numel())


def user_batches(rows: int, steps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
        out.append({"x": x, "y": np.sin(x.sum(axis=1))})
    return out


def trajectory(step, batches) -> dict[str, list[float]]:
    """Each step's loss and gradient norm, then the trained model's loss on the first batch
    (`evaluate`: a forward only, through every stage in turn)."""
    rows = [{key: np.asarray(v)[step.rows()] for key, v in batch.items()} for batch in batches]
    metrics = [step(batch) for batch in rows]
    out = {key: [float(m[key]) for m in metrics] for key in ("loss", "grad_norm")}
    loss_sum, tokens = step.evaluate(rows[0])
    return {**out, "evaluated": [loss_sum / tokens]}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    runtime = TorchRuntime()
    runtime.join()
    results: dict = {"reference": {}, "user": {}}
    for name, overrides in job["reference"].items():
        spec = load_spec(None, overrides)
        step = TorchStep(spec, runtime.build_mesh(spec), job["steps"], runtime.device)
        data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
        results["reference"][name] = trajectory(step, [data.batch(i) for i in range(job["steps"])])
    for name, overrides in job["user"].items():
        spec = load_spec(None, overrides)
        step = trainspec.torch.wrap(Net, user_loss, spec, mesh=runtime.build_mesh(spec),
                                    fsdp_units=("blocks.*",), pipeline_io=USER_PIPELINE)
        results["user"][name] = trajectory(step, user_batches(spec.batch.global_batch,
                                                              job["steps"]))
    if runtime.is_writer():
        Path(job["out"]).write_text(json.dumps(results))
    runtime.leave()


if __name__ == "__main__":
    main()
