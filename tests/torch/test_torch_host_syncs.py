"""A step the run loop does not record reads nothing on the host: no loss, token count,
gradient norm or non-finite verdict is brought to the host between records (HostSyncs counts
every way Python reads a tensor's value). On one rank in this process, and on 2 gloo ranks
under the data layout (gradients reduced while the backward runs, the scalars riding with
them), fsdp (FSDP2's reduce-scatters, the scalars on their own) and data with 2 micro-batches.
The counter itself counts: the step's host-facing call (`step(batch)`, which returns numbers)
is caught reading them."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from host_syncs import HostSyncs
from tiny import TINY, tiny_spec
from trainspec.core.data import ByteBatches
from trainspec.torch.engine import TorchEngine
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.train import TorchStep

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def one_rank():
    adapter = TorchRuntime()
    adapter.join()  # no launcher in the environment: a job of one rank
    spec = tiny_spec("batch.micro_batch=8")  # 2 micro-batches: the noise scale measured
    step = TorchStep(spec, adapter.build_mesh(spec), 10, adapter.device)
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    yield TorchEngine(step, adapter), step, (lambda i: data.batch(i, step.rows()))
    adapter.leave()


def test_an_unrecorded_step_reads_nothing_on_one_rank(one_rank):
    engine, step, batch = one_rank
    engine(step, batch(0))  # the first update is decided on the host
    with HostSyncs() as syncs:
        for i in range(1, 4):
            _, metrics = engine(step, batch(i))
    assert syncs.where == []
    record = engine.to_host(metrics)  # a record reads them, once
    assert record["nonfinite"] == 0 and record["valid_tokens"] > 0 and record["gns_trace"]


def test_the_counter_catches_a_step_that_reads(one_rank):
    _, step, batch = one_rank
    with HostSyncs() as syncs:
        step(batch(4))  # the host-facing call returns numbers: it reads them
    assert syncs.count > 0


def test_an_unrecorded_step_reads_nothing_on_two_ranks(tmp_path):
    layouts = {
        "data": [*TINY, "mesh.axes.data.size=2"],
        "fsdp": [*TINY, "mesh.axes.data.size=1", "mesh.axes.fsdp.size=2"],
        "data_micro": [*TINY, "mesh.axes.data.size=2", "batch.micro_batch=4"],
    }
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"layouts": layouts, "steps": 3, "out": str(tmp_path / "out.json")}))
    cmd = [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", "2", "--",
           sys.executable, str(HERE / "host_sync_worker.py"), str(job)]
    # the worker imports host_syncs from here (the suite runs subprocesses with PYTHONSAFEPATH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((tmp_path / "out.json").read_text()) == {name: [] for name in layouts}
