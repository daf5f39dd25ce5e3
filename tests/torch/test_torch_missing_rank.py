"""A stopped rank on PyTorch (4 gloo ranks): every surviving rank's collective gives up after
collectives.timeout_s and names the stopped rank in one line; the launcher blames it, not the
first rank to exit, and the job ends with exit 2 within the timeout and a margin."""
import re
import subprocess
import sys

from run_dirs import stop_rank_when_recorded
from tiny import TINY
from xla_env import without_device_count

TIMEOUT_S = 10
MARGIN_S = 30  # the survivors' exit and the launcher's under the suite's load


def test_a_stopped_rank_is_named_by_every_survivor_and_blamed_by_the_launcher(tmp_path):
    sets = [*TINY, "metrics.interval=1", f"collectives.timeout_s={TIMEOUT_S}"]
    job = subprocess.Popen(
        [sys.executable, "-m", "trainspec.cli.main", "train", "--framework", "torch",
         "--nprocs", "4", "--quiet", "--steps", "10000", "--run-dir", str(tmp_path),
         *[a for s in sets for a in ("--set", s)]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=without_device_count())
    code, elapsed, out, pids = stop_rank_when_recorded(job, tmp_path, rank=2)
    assert code == 2, out[-4000:]
    assert elapsed < TIMEOUT_S + MARGIN_S, elapsed
    named = re.findall(
        rf"\[rank (\d)\] trainspec: error: collectives.timeout_s: step \d+'s \w+ waited up to "
        rf"{TIMEOUT_S} s for rank\(s\) 2, which did not arrive \(rank 2 last entered step \d+, "
        rf"its process {pids[2]} stopped; rank \1 had entered step \d+\)", out)
    assert named and set(named) <= {"0", "1", "3"}, out[-4000:]
    assert "[launch] rank(s) 2 did not arrive (rank " in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
