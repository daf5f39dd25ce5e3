"""A worker script run as the ranks of one job (`trainspec launch --nprocs N -- python WORKER
JOB.json`), its folder on the ranks' path; the tests read what its rank 0 wrote."""
import os
import subprocess
import sys
from pathlib import Path


def launch_worker(worker: Path, job: Path, nprocs: int, timeout: float = 600) -> None:
    """Runs `worker` with the job file on `nprocs` ranks from the job's folder; fails the test
    with the output's tails unless every rank exits 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(worker.parent), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", str(nprocs), "--",
         sys.executable, str(worker), str(job)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=job.parent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
