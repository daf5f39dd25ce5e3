"""One rank of test_validate_torch.py's job: builds (does not train) the torch layouts of the job
file and, on rank 0, writes each parameter's actual split and local block.

Run under `trainspec launch --nprocs 4 -- python torch_layout_worker.py JOB.json`. JOB:
{"layouts": {name: [model reference or null for the reference model, spec overrides]}, "out"}.
"""
import json
import sys
from pathlib import Path

from torch.distributed.tensor import DTensor

from trainspec.core import user_model
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.train import TorchStep
from trainspec.torch.step import WrappedStep


def actual(param) -> list:
    """[{mesh axis: split dimension}, local shape] of one parameter as the ranks hold it."""
    splits = {}
    if isinstance(param, DTensor):
        for axis, placement in zip(param.device_mesh.mesh_dim_names, param.placements):
            if not placement.is_replicate():
                splits[axis] = placement.dim  # Shard and FSDP2's _StridedShard alike
        param = param.to_local()
    return [splits, list(param.shape)]


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    adapter = TorchRuntime()
    adapter.join()
    found = {}
    for name, (reference, overrides) in job["layouts"].items():
        spec = load_spec(DEFAULT_SPEC_PATH, overrides)
        mesh = adapter.build_mesh(spec)
        if reference is None:
            step = TorchStep(spec, mesh, 1, adapter.device)
        else:
            model = user_model.load(reference, spec)
            step = WrappedStep(model.init, model.loss, spec, mesh=mesh, device=adapter.device,
                               optimizer_fn=model.optimizer)
        found[name] = {n: actual(p) for n, p in step.model.named_parameters()}
    if adapter.is_writer():
        Path(job["out"]).write_text(json.dumps(found))
    adapter.leave()


if __name__ == "__main__":
    main(sys.argv[1])
