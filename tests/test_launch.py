"""`trainspec launch`: ranks run together, output is prefixed, a dead rank stops the job."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

LAUNCH = [sys.executable, "-m", "spec_jax.cli.main", "launch"]
BOUND_S = 30  # a failed job must be fully stopped within this: grace 2 s, the rest is margin for 2 loaded cores


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def _start(*command, nprocs=2):
    return subprocess.Popen(
        [*LAUNCH, "--nprocs", str(nprocs), "--grace", "2", "--", *command],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _pids(lines):
    return [int(m.group(1)) for line in lines if (m := re.match(r"\[launch\] rank \d+ pid (\d+)", line))]


def test_ranks_get_their_identity_and_prefixed_output():
    script = ("import os; print('id', os.environ['TRAINSPEC_PROCESS_ID'], 'of', "
              "os.environ['TRAINSPEC_NUM_PROCESSES'], os.environ['TRAINSPEC_COORDINATOR'])")
    out, _ = _start(sys.executable, "-c", script, nprocs=3).communicate(timeout=60)
    for rank in range(3):
        assert re.search(rf"^\[rank {rank}\] id {rank} of 3 127\.0\.0\.1:\d+$", out, re.M), out


def _run_until_failure(fail_how):
    """Rank 1 fails (exit 3, or SIGKILL from outside); rank 0 would sleep for 10 minutes."""
    script = ("import os, sys, time\n"
              "rank = int(os.environ['TRAINSPEC_PROCESS_ID'])\n"
              "print('ready', flush=True)\n"
              "if rank == 1 and sys.argv[1] == 'exit': time.sleep(1); sys.exit(3)\n"
              "time.sleep(600)\n")
    job = _start(sys.executable, "-c", script, fail_how)
    lines = []
    while len(_pids(lines)) < 2 or sum("ready" in line for line in lines) < 2:
        lines.append(job.stdout.readline())
    pids = _pids(lines)
    t0 = time.monotonic()
    if fail_how == "kill":
        os.kill(pids[1], signal.SIGKILL)
    code = job.wait(timeout=BOUND_S + 10)
    elapsed = time.monotonic() - t0
    return code, elapsed, pids


@pytest.mark.parametrize("fail_how, expected_code", [("exit", 3), ("kill", 137)])
def test_a_failed_rank_stops_the_job_within_bound(fail_how, expected_code):
    code, elapsed, pids = _run_until_failure(fail_how)
    assert code == expected_code
    assert elapsed < BOUND_S
    assert not any(_alive(pid) for pid in pids), "a rank outlived the job"


def test_missing_command_is_one_line_exit_2():
    result = subprocess.run([*LAUNCH, "--nprocs", "2"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "trainspec: error: launch: give the command after --, e.g. -- trainspec train"
