"""`trainspec launch`: ranks run together, output is prefixed, a dead rank stops the job."""
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from trainspec.core import launch

LAUNCH = [sys.executable, "-m", "trainspec.cli.main", "launch"]
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


@pytest.mark.skipif(sys.platform != "linux", reason="the ephemeral port range is read from Linux's /proc")
def test_the_coordinator_port_is_drawn_below_the_ports_the_kernel_hands_out():
    """The launcher releases the port before rank 0 binds it. One from bind(0) lies in the
    kernel's ephemeral range, where any connection may take it in that gap (seen under the
    suite's load: rank 0's EADDRINUSE); below it, only a process naming the port can. Drawn
    apart from the caller's random.seed, so concurrent launches do not draw alike."""
    with open(launch.EPHEMERAL_RANGE) as f:
        low = int(f.read().split()[0])
    ports = []
    for _ in range(10):
        random.seed(0)
        ports.append(launch.free_port())
    assert all(low - launch.PORTS_BELOW_EPHEMERAL <= port < low for port in ports), ports
    assert len(set(ports)) > 1, ports


def test_missing_command_is_one_line_exit_2():
    result = subprocess.run([*LAUNCH, "--nprocs", "2"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "trainspec: error: launch: give the command after --, e.g. -- trainspec train"


def test_the_first_rank_to_fail_is_named_with_its_signal():
    """Rank 1 is killed; rank 0 then aborts (as a gloo peer does, exit 134): the launcher
    names rank 1, the first to fail, and its signal, and exits as rank 1 did."""
    script = ("import os, signal, sys, time\n"
              "print('ready', flush=True)\n"
              "if os.environ['TRAINSPEC_PROCESS_ID'] == '1': time.sleep(1); "
              "os.kill(os.getpid(), signal.SIGKILL)\n"
              "time.sleep(1.3); sys.exit(134)\n")
    out, _ = _start(sys.executable, "-c", script).communicate(timeout=60)
    assert "[launch] rank 1 was killed by SIGKILL first; stopping the others" in out, out
    assert "rank 0" not in out.split("first;")[0].splitlines()[-1]


def test_sigterm_is_forwarded_and_the_ranks_get_the_grace_period_to_save():
    """Each rank takes 1 s to 'save' after SIGTERM, then exits 143: the launcher waits for
    both (grace 10 s), reports them, and exits 143."""
    script = ("import os, signal, sys, time\n"
              "def stop(*_): time.sleep(1); print('saved', flush=True); sys.exit(143)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "print('ready', flush=True)\n"
              "time.sleep(600)\n")
    job = subprocess.Popen([*LAUNCH, "--nprocs", "2", "--grace", "10", "--", sys.executable,
                            "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    lines = []
    while sum("ready" in line for line in lines) < 2:
        lines.append(job.stdout.readline())
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 143, out
    assert out.count("] saved") == 2, out
    assert "[launch] rank 0 exited with status 143, rank 1 exited with status 143" in out, out


def test_gloo_connection_lines_show_only_with_verbose():
    """gloo prints this line for every rank at every connection (format from the
    `peer ranks. Expected number of connected peer ranks is : ` string in jaxlib's gloo); a
    progress bar's carriage return splits it in a real 2-process run."""
    notice = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    split_by_a_bar = notice.replace(". ", ". \r")
    split_after_rank = notice.replace("Rank ", "Rank \r")  # as a 2 x 4-device launch printed it
    # two threads of one rank writing their pieces at once
    interleaved = ("[Gloo] Rank [Gloo] Rank 23 is connected to 3 peer ranks.  is connected to 3 peer "
                   "ranks. Expected number of connected peer ranks is : 3Expected number of "
                   "connected peer ranks is : 3")
    script = (f"print({notice!r}); print('[Gloo] Rank 0 is NOT connected to: [1]'); "
              f"print('train: 0%|', end='\\r'); print({notice!r}); "
              f"print({split_by_a_bar!r}); print({split_after_rank!r}); print({interleaved!r}); "
              f"print('step 12 of 40'); print('done')")

    def output(*flags):
        done = subprocess.run([*LAUNCH, "--nprocs", "1", *flags, "--", sys.executable, "-c", script],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    quiet, verbose = output(), output("-v")
    assert "is connected to" not in quiet
    assert [line for line in quiet.splitlines() if line.startswith("[rank 0]")] == [
        "[rank 0] [Gloo] Rank 0 is NOT connected to: [1]", "[rank 0] train: 0%|",
        "[rank 0] step 12 of 40", "[rank 0] done"], quiet  # a failure and what shared a line stay
    assert "[rank 0] [Gloo] Rank 0 is connected to 1 peer ranks." in verbose


# In this process (jax imported by conftest) the launcher forks its ranks: jax warns about any
# fork; the child only sets its affinity and parent-death signal before it execs.
@pytest.mark.filterwarnings("ignore:os.fork")
def test_sigterm_reports_every_rank_even_before_its_exit_watcher_records_it(monkeypatch, capsys):
    """The launcher's SIGTERM report names each rank's status once the ranks are stopped, also
    when a thread watching a rank's exit has not recorded it yet (it once printed rank 0 only)."""
    from trainspec.core import launch

    watch = launch.Launch._watch

    def late_watch(self, rank, child):  # records the exit 3 s after the child has gone
        child.wait()
        time.sleep(3)
        watch(self, rank, child)

    monkeypatch.setattr(launch.Launch, "_watch", late_watch)
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
              "time.sleep(600)\n")
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(SystemExit) as stopped:
            launch.run([sys.executable, "-c", script], nprocs=2, grace_s=10)
    finally:
        timer.cancel()  # should run() end early, the SIGTERM must not reach the test process
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "[launch] rank 0 exited with status 143, rank 1 exited with status 143\n" in \
        capsys.readouterr().err


def test_lines_from_many_threads_come_out_whole():
    import io

    from trainspec.core.launch import _say

    out = io.StringIO()
    threads = [threading.Thread(target=lambda r=r: [_say(f"[rank {r}] line {i}", out)
                                                    for i in range(500)]) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2000 and all(re.fullmatch(r"\[rank \d\] line \d+", x) for x in lines)


def test_a_refusal_every_rank_says_is_one_line():
    """Every rank refuses the same bad input (a spec field) in the same line, exit 2: the
    launcher relays it once and adds no line of its own; a different line still comes
    through."""
    script = ("import os, sys, time\n"
              "rank = os.environ['TRAINSPEC_PROCESS_ID']\n"
              "time.sleep(0.5 * int(rank))\n"
              "print('trainspec: error: batch.global_batch: 7 is not a multiple of 2', "
              "file=sys.stderr, flush=True)\n"
              "if rank == '2': print('trainspec: error: --run-dir: rank 2 alone', file=sys.stderr)\n"
              "sys.exit(2)\n")
    job = _start(sys.executable, "-c", script, nprocs=3)
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 2, out
    said = [line for line in out.splitlines() if not re.match(r"\[launch\] rank \d pid", line)]
    # rank 0 speaks first unless a loaded machine starts it last
    assert re.fullmatch(r"\[rank \d\] trainspec: error: batch.global_batch: 7 is not a "
                        r"multiple of 2", said[0]), out
    assert said[1:] in ([], ["[rank 2] trainspec: error: --run-dir: rank 2 alone"]), out


def test_a_peer_that_only_lost_the_rank_that_said_why_adds_no_line():
    """Rank 0 stops with its one line (a full disk, say); rank 1's next collective then
    fails for want of rank 0, and it says so while the launcher stops it: rank 0's line is the
    job's one line."""
    script = ("import os, signal, sys, time\n"
              "if os.environ['TRAINSPEC_PROCESS_ID'] == '0':\n"
              "    time.sleep(1.5)\n"
              "    print('trainspec: error: --run-dir r: No space left on device', flush=True)\n"
              "    sys.exit(2)\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # still saying its line\n"
              "time.sleep(2.5)\n"
              "print('trainspec: error: collectives.timeout_s: step 3\\'s all_reduce waited up "
              "to 5 s for rank(s) 0, which did not arrive (rank 0 is gone)', flush=True)\n"
              "time.sleep(600)\n")
    job = subprocess.run([*LAUNCH, "--nprocs", "2", "--grace", "4", "--", sys.executable, "-c",
                          script], capture_output=True, text=True, timeout=60)
    out = job.stdout + job.stderr
    assert job.returncode == 2, out
    said = [line for line in out.splitlines() if not re.match(r"\[launch\] rank \d pid", line)]
    assert said == ["[rank 0] trainspec: error: --run-dir r: No space left on device"], out
