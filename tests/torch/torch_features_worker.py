"""One rank of the step-feature runs of test_torch_features.py (remat, ZeRO-1, compression, GNS).

Run under `trainspec launch --nprocs 4 -- python torch_features_worker.py JOB.json`. Every rank
runs, in turn:
- each `layouts` entry from the JAX run's initial parameters on ragged batches
  (trainspec.core.conformance_runner.ragged_batch), recording the step metrics and each rank's
  optimizer state bytes (local blocks, tensors of one dimension or more);
- each `resumes` entry: `first` for `at` steps, saved and continued (`saver`), then restored
  into `then` and continued; the sum over replicas of the error-feedback residuals is recorded
  at the save and after the restore;
- each `compressed_sums` case: rank r reduces row r of the job's inputs (and residuals) with
  trainspec.torch.compression.CompressedSum over all ranks.
Rank 0 writes everything to the job's `out` file.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trainspec.core.conformance_runner import ragged_batch
from trainspec.core.data import ByteBatches
from trainspec.core.params_file import unflatten
from trainspec.core.spec import load_spec
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.checkpoint import TorchCheckpointer
from trainspec.torch.compression import CompressedSum
from trainspec.torch.layout import local_block
from trainspec.torch.models.transformer import Transformer, from_flax
from trainspec.torch.train import TorchStep

RECORDED = ("loss", "grad_norm", "gns_grad_sq", "gns_trace")


def build(job, adapter, overrides) -> TorchStep:
    spec = load_spec(job["spec"], overrides)
    initial = from_flax(Transformer(spec.model), unflatten(dict(np.load(job["params"]))))
    return TorchStep(spec, adapter.build_mesh(spec), job["steps"], adapter.device, initial)


def train(step: TorchStep, steps: range, record: dict) -> None:
    spec = step.spec
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    for i in steps:
        metrics = step({k: v[step.rows()] for k, v in ragged_batch(data, i).items()})
        for key in RECORDED:
            record.setdefault(key, []).append(metrics.get(key))


def state_bytes(step: TorchStep) -> int:
    return sum(local_block(v).numel() * v.element_size() for values in step.optimizer.state.values()
               for v in values.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def residual_sum(step: TorchStep) -> list[float] | None:
    """Every replica's error-feedback residual, summed (what error feedback still owes)."""
    reduction = step.reduction
    if reduction is None or reduction.compressed is None or reduction.compressed.residual is None:
        return None
    total = reduction.compressed.residual.clone()
    dist.all_reduce(total, group=reduction.group)
    return total.tolist()


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    adapter = TorchRuntime()
    adapter.join()
    out: dict = {"layouts": {}, "resumes": {}, "compressed_sums": []}
    for name, overrides in job.get("layouts", {}).items():
        step, record = build(job, adapter, overrides), {}
        train(step, range(job["steps"]), record)
        record["state_bytes"] = adapter.gather_objects(state_bytes(step))
        out["layouts"][name] = record
    for name, resume in job.get("resumes", {}).items():
        first, record = build(job, adapter, resume["first"]), {}
        train(first, range(resume["at"]), {})
        saved = TorchCheckpointer(first.spec, Path(job["dir"]) / name)
        first.save(saved, resume["at"])
        saved.wait()  # checkpoint.async_save: complete before another checkpointer reads it
        record["residual_saved"] = residual_sum(first)
        train(first, range(resume["at"], job["steps"]), record.setdefault("saver", {}))
        then = build(job, adapter, resume["then"])
        record["restored_at"] = then.restore(TorchCheckpointer(then.spec, Path(job["dir"]) / name))
        record["residual_restored"] = residual_sum(then)
        train(then, range(resume["at"], job["steps"]), record)
        out["resumes"][name] = record
    if job.get("compressed_sums"):
        inputs = np.load(job["inputs"])
        me = adapter.process_index
        for compression, block, feedback in job["compressed_sums"]:
            reduce = CompressedSum(compression, block, feedback, dist.group.WORLD)
            reduce.residual = torch.from_numpy(inputs["residuals"][me])
            total = reduce(torch.from_numpy(inputs["x"][me]))
            reduce.commit()
            residual = reduce.residual.numpy().tolist() if feedback else None
            out["compressed_sums"].append(
                adapter.gather_objects((total.numpy().tolist(), residual)))
    if adapter.is_writer():
        Path(job["out"]).write_text(json.dumps(out))
    adapter.leave()


if __name__ == "__main__":
    main(sys.argv[1])
