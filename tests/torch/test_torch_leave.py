"""A torch rank leaves no process group behind (trainspec.torch.runtime.leave): once `run`
returns, every group the job had when it left is freed (on one rank: the default group), so
that gloo's worker and transport threads are joined while the interpreter is whole. Left to
interpreter exit, a loaded rank sometimes aborted after its job had finished (SIGABRT,
"terminate called without an active exception")."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# One rank in its own process (no launcher in the environment: a job of one rank). Every group
# the job has when it leaves is watched by a weak reference; printed: how many, how many live.
RANK = '''
import sys, weakref
from pathlib import Path
sys.path.insert(0, sys.argv[2])  # tests/, for tiny
from torch.distributed.distributed_c10d import _world
from tiny import tiny_spec
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.train import run

watched, leave = [], TorchRuntime.leave

def watching_leave(self):
    watched.extend(weakref.ref(group) for group in _world.pg_map)
    leave(self)

TorchRuntime.leave = watching_leave
spec = tiny_spec("mesh.axes.data.size=1", "mesh.axes.fsdp.size=1", "mesh.axes.tensor.size=1",
                 "checkpoint.interval=0")
run(spec, Path(sys.argv[1]), steps=2, progress=False)
print(len(watched), sum(ref() is not None for ref in watched))
'''


def test_no_process_group_outlives_run(tmp_path):
    result = subprocess.run([sys.executable, "-c", RANK, str(tmp_path / "run"),
                             str(ROOT / "tests")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    groups, alive = map(int, result.stdout.split()[-2:])
    assert groups >= 1  # the default one at least
    assert alive == 0, f"{alive} of the job's {groups} process groups are still alive"
