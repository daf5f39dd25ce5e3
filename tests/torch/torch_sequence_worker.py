"""One rank of the context and expert runs of test_torch_context.py and test_torch_moe.py.

Run under `trainspec launch --nprocs 4 -- python torch_sequence_worker.py JOB.json`. Every rank
trains each `layouts` entry in turn ({name: spec overrides}) for `steps` steps on ragged batches
(trainspec.core.golden.ragged_batch), from the parameters `params` names for it ({name: a flat
.npz of a JAX run's initial parameters}) or else the seeded draws, and records each step's loss, gradient
norm and, with experts, the aux metrics. Rank 0 writes {name: record} to the job's `out`.
The layouts named in `broken` run a deliberately wrong implementation (BREAKAGES).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import trainspec.torch.context
import trainspec.torch.models.moe
from trainspec.core.data import ByteBatches
from trainspec.core.golden import ragged_batch
from trainspec.core.params_file import unflatten
from trainspec.core.spec import load_spec
from trainspec.torch.models.transformer import Transformer, from_flax
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.train import TorchStep


BREAKAGES = {
    # each ring step scores the block it holds under the next block's positions: the causal
    # mask one block off
    "ring_mask_one_block_off": (trainspec.torch.context, "held_block",
                                lambda rank, step, n: (rank - step + 1) % n),
}


def _route_later_rows_first(logits, *args):
    """The routing of every row unchanged, but the capacity's drop order reversed: a router
    that drops the wrong tokens."""
    routed = _ROUTE(logits.flip(0), *args)
    return {**routed, "weights": routed["weights"].flip(0)}


_ROUTE = trainspec.torch.models.moe.route
BREAKAGES["router_drops_earlier_rows"] = (trainspec.torch.models.moe, "route",
                                          _route_later_rows_first)


def build(job, adapter, name) -> TorchStep:
    spec = load_spec(job["spec"], job["layouts"][name])
    initial = None
    if name in job["params"]:
        flat = dict(np.load(job["params"][name]))
        initial = from_flax(Transformer(spec.model), unflatten(flat))
    return TorchStep(spec, adapter.build_mesh(spec), job["steps"], adapter.device, initial)


def train(step: TorchStep, steps: int) -> dict:
    spec, record = step.spec, {}
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    for i in range(steps):
        metrics = step({k: v[step.rows()] for k, v in ragged_batch(data, i).items()})
        for key in ("loss", "grad_norm", "gns_grad_sq", "gns_trace"):
            if key in metrics:
                record.setdefault(key, []).append(metrics[key])
        for key, value in metrics.get("aux", {}).items():
            record.setdefault(key, []).append(np.asarray(value).tolist())
    return record


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    adapter = TorchRuntime()
    adapter.join()
    out = {}
    for name in job["layouts"]:
        broken = job.get("broken", {}).get(name)
        if broken:
            module, attribute, wrong = BREAKAGES[broken]
            right = getattr(module, attribute)
            setattr(module, attribute, wrong)
        out[name] = train(build(job, adapter, name), job["steps"])
        if broken:
            setattr(module, attribute, right)
    if adapter.is_writer():
        Path(job["out"]).write_text(json.dumps(out))
    adapter.leave()


if __name__ == "__main__":
    main(sys.argv[1])
