"""One rank of test_torch_host_syncs.py's job: the reference job's engine (the run loop's
step, trainspec.torch.engine.TorchEngine) on each layout of JOB.json's "layouts", a few steps
first (the first update is decided on the host), then `steps` steps counted with HostSyncs;
rank 0 writes {layout: [the calls counted]} to "out".

Run under `trainspec launch --nprocs N -- python host_sync_worker.py JOB.json`."""
import json
import sys
from pathlib import Path

from host_syncs import HostSyncs
from trainspec.core.data import ByteBatches
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.torch.engine import TorchEngine
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.train import TorchStep


def main(path: str) -> None:
    job = json.loads(Path(path).read_text())
    adapter = TorchRuntime()
    adapter.join()
    out = {}
    for name, overrides in job["layouts"].items():
        spec = load_spec(DEFAULT_SPEC_PATH, overrides)
        step = TorchStep(spec, adapter.build_mesh(spec), 10, adapter.device)
        engine = TorchEngine(step, adapter)
        data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
        for i in range(2):
            engine(step, data.batch(i, step.rows()))
        with HostSyncs() as syncs:
            for i in range(2, 2 + job["steps"]):
                _, metrics = engine(step, data.batch(i, step.rows()))
        out[name] = syncs.where
        engine.to_host(metrics)  # the record's read still gives numbers
    if adapter.is_writer():
        Path(job["out"]).write_text(json.dumps(out))
    adapter.leave()


if __name__ == "__main__":
    main(sys.argv[1])
