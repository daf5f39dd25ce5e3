"""One rank of the cross-framework equality runs (test_torch_equality.py).

Run under `trainspec launch --nprocs 4 -- python torch_equality_worker.py JOB.json`: every rank runs
each layout of the job in turn (one process group, one DeviceMesh per layout), starting from
the JAX run's initial parameters (an .npz of the flax tree), on the same ragged batches; rank 0
writes the loss and gradient-norm trajectories to the job's `out` file. A layout named `mean_of_means` trains
with the rule the spec forbids, to show that the comparison can fail.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from trainspec.torch.adapter import TorchAdapter
from trainspec.torch.model import Transformer, from_flax, next_token_loss
from trainspec.torch.step import TorchStep
from trainspec.core.conformance_runner import ragged_batch
from trainspec.core.spec import load_spec
from trainspec.core.data import ByteBatches


class MeanOfMicroBatchMeans(TorchStep):
    """Each micro-batch normalised by its own tokens; the means averaged over micro-batches
    and ranks (DeepSpeed's default). Returned as (loss, 1/shards) so that the base class's
    division by the summed "tokens" divides by 1."""

    def _accumulate(self, rows):
        k, n = self.spec.batch.accumulation_steps, self.shards
        batch = {key: torch.from_numpy(v) for key, v in rows.items()}
        total = torch.zeros(())
        for j in range(k):
            micro = {key: v[j::k] for key, v in batch.items()}
            loss_sum, tokens = next_token_loss(self.model(micro["inputs"]), micro["targets"],
                                               micro["mask"])
            mean = loss_sum / tokens / (k * n)
            mean.backward()
            total += mean.detach()
        return torch.stack([total, torch.tensor(1.0 / n)])


def unflatten(npz) -> dict:
    tree: dict = {}
    for key in npz.files:
        *path, leaf = key.split("/")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = npz[key]
    return tree


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    adapter = TorchAdapter()
    adapter.join()
    flax_params = unflatten(np.load(job["params"]))
    trajectories = {}
    for name, overrides in job["layouts"].items():
        spec = load_spec(job["spec"], overrides)
        initial = from_flax(Transformer(spec.model), flax_params)
        kind = MeanOfMicroBatchMeans if name == "mean_of_means" else TorchStep
        step = kind(spec, adapter.build_mesh(spec), job["steps"], adapter.device, initial)
        data, rows = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed), step.rows()
        trajectory = {"loss": [], "grad_norm": []}
        for i in range(job["steps"]):
            batch = {k: v[rows] for k, v in ragged_batch(data, i).items()}
            metrics = step(batch)
            for key, values in trajectory.items():
                values.append(metrics[key])
        trajectories[name] = trajectory
    if adapter.is_writer():
        Path(job["out"]).write_text(json.dumps(trajectories))
    adapter.leave()


if __name__ == "__main__":
    main(sys.argv[1])
