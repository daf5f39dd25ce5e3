"""A torch job described as a Kubernetes Indexed Job describes it: one coordinator and count for
every pod, the process id from JOB_COMPLETION_INDEX (trainspec.core.job_env, as on JAX)."""
import os
import socket
import subprocess
import sys

JOIN = """
import torch, torch.distributed as dist
from trainspec.torch.runtime import TorchRuntime
adapter = TorchRuntime(30.0)
adapter.join()
total = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(total)
print(dist.get_rank(), dist.get_world_size(), int(total))
adapter.leave()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_pod_joins_as_its_completion_index(tmp_path):
    base = {k: v for k, v in os.environ.items()
            if k not in ("TRAINSPEC_PROCESS_ID", "RANK", "WORLD_SIZE", "JOB_COMPLETION_INDEX")}
    base.update(TRAINSPEC_COORDINATOR=f"127.0.0.1:{_port()}", TRAINSPEC_NUM_PROCESSES="2")
    pods = [subprocess.Popen([sys.executable, "-c", JOIN], cwd=tmp_path, text=True,
                             env={**base, "JOB_COMPLETION_INDEX": str(index)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for index in (1, 0)]
    outputs = [pod.communicate(timeout=120) for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], outputs
    assert [out.split() for out, _ in outputs] == [["1", "2", "3"], ["0", "2", "3"]]
