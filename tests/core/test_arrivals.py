"""Naming the ranks that did not arrive (trainspec.core.arrivals) and the launcher's blame."""
import os
import signal
import subprocess
import sys
import time

from trainspec.core import arrivals, launch


def _mark(run_dir, rank, step, pid=None):
    arrivals.StepMarks(run_dir, rank, world=4)  # creates the mark of this process at step 0
    mark = run_dir / arrivals.MARKS_DIR / str(rank)
    _, own_pid, host = mark.read_text().split()
    mark.write_text(f"{step} {pid or own_pid} {host}\n")


def test_a_rank_behind_the_others_is_named_at_the_step_it_did_not_join(tmp_path):
    for rank, step in ((0, 5), (1, 5), (2, 4), (3, 5)):
        _mark(tmp_path, rank, step)
    assert arrivals.missing(tmp_path, 4, me=0) == {2: (5, "rank 2 last entered step 4")}
    line = arrivals.peer_lost_line(tmp_path, 4, 0, "all_reduce", 30)
    assert line == ("collectives.timeout_s: step 5's all_reduce waited up to 30 s for rank(s) "
                    "2, which did not arrive (rank 2 last entered step 4; rank 0 had entered "
                    "step 5); the same command resumes from the newest good checkpoint")
    assert arrivals.BLAME.search(line).group(1) == "2"


def test_a_stopped_or_gone_process_is_named_even_at_the_same_step(tmp_path):
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        _mark(tmp_path, 0, 7)
        _mark(tmp_path, 1, 7, pid=stopped.pid)
        _mark(tmp_path, 2, 7, pid=gone.pid)
        assert arrivals.missing(tmp_path, 3, me=0) == {
            1: (7, f"rank 1 last entered step 7, its process {stopped.pid} stopped"),
            2: (7, f"rank 2 last entered step 7, its process {gone.pid} gone")}
    finally:
        stopped.kill()
        stopped.wait()


def test_a_stopped_process_is_named_alone_when_a_rank_got_a_step_ahead(tmp_path):
    # seen in CI: rank 0 finished the collective rank 2 was stopped inside and entered step 3
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        for rank, step in ((0, 3), (1, 2), (3, 2)):
            _mark(tmp_path, rank, step)
        _mark(tmp_path, 2, 2, pid=stopped.pid)
        for me in (0, 1, 3):
            assert arrivals.missing(tmp_path, 4, me=me) == {
                2: (3, f"rank 2 last entered step 2, its process {stopped.pid} stopped")}
    finally:
        stopped.kill()
        stopped.wait()


def test_no_rank_behind_is_said_so(tmp_path):
    _mark(tmp_path, 0, 3)
    _mark(tmp_path, 1, 3)
    assert "no rank is known to be behind" in arrivals.peer_lost_line(
        tmp_path, 2, 0, "all-reduce", 5)


def test_one_process_leaves_no_mark(tmp_path):
    arrivals.StepMarks(tmp_path, 0, world=1).entered(3)
    assert not (tmp_path / arrivals.MARKS_DIR).exists()


def test_xla_names_its_collective():
    assert arrivals.collective_of("Gloo all-reduce failed: Timed out waiting 5000ms") == "all-reduce"
    assert arrivals.peer_lost("Gloo AllGather failed: Connection reset by peer")
    assert arrivals.peer_lost("UNKNOWN: Gloo context initialization failed: DEADLINE_EXCEEDED")
    # torch's gloo, on a rank whose pair was closed by another wait's timeout (seen in CI)
    assert arrivals.peer_lost("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                              "Application timeout caused pair closure")
    assert not arrivals.peer_lost("RESOURCE_EXHAUSTED: out of memory")


def test_the_launcher_blames_the_rank_named_not_the_first_to_exit(capsys):
    """Rank 0 exits 2 first, saying rank 1 did not arrive; rank 1 hangs: the launcher names
    rank 1 and kills it at once, without waiting out the grace period."""
    script = ("import os, sys, time\n"
              "if os.environ['TRAINSPEC_PROCESS_ID'] == '0':\n"
              "    print('trainspec: error: collectives.timeout_s: step 3\\'s all-reduce waited "
              "up to 5 s for rank(s) 1, which did not arrive (...)', flush=True)\n"
              "    sys.exit(2)\n"
              "time.sleep(60)\n")
    t0 = time.monotonic()
    assert launch.run([sys.executable, "-c", script], 2, grace_s=30) == 2
    assert time.monotonic() - t0 < 15
    err = capsys.readouterr().err
    assert ("[launch] rank(s) 1 did not arrive (rank 0 exited with status 2 saying so); "
            "stopping the others") in err, err
