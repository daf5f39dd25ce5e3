"""One job at a time in a run directory, for every implementation.

Two jobs training into one run dir interleave their metrics records and overwrite each other's
checkpoints. So the job's first process takes an exclusive `flock` on RUN_DIR/run.lock and
holds it for its whole life: the kernel releases it when the process ends, however it ends
(kill -9 included), so a lock left behind by a killed run is simply taken over; no pid has to
be judged alive or dead, on this host or another. The file records who holds it (pid, host,
since when) for the refusal line of the job that comes second.

Only one process of a job holds it (a second flock from another process of the same job would
fail like a stranger's): the one that starts the job. A launcher that holds it for its ranks
(`trainspec train --framework torch` starting its own) says so in the environment its ranks
inherit, and they do not try again.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from trainspec.core.errors import UserInputError

LOCK_FILE = "run.lock"
# Set to the lock file's path by the process holding it: its children (ranks it starts) are
# part of its job.
HELD_BY_PARENT = "TRAINSPEC_RUN_DIR_LOCK"

_held: dict[str, int] = {}  # lock file path -> the descriptor holding its lock


def hold(run_dir: Path, first_process: bool) -> None:
    """Lock `run_dir` (created if missing) for this process's job until `release_all()` or
    the process's end; a no-op on a job's other processes (`first_process` False) and under
    a parent that holds it. Raises UserInputError naming the holder when another job has it."""
    path = str(_lock_path(run_dir))
    if not first_process or path in _held or os.environ.get(HELD_BY_PARENT) == path:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise UserInputError(
            f"--run-dir {run_dir} is in use by another run ({holder}); wait for it to end or "
            "choose another --run-dir") from None
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)  # a killed holder's record is replaced
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held[path] = fd
    os.environ[HELD_BY_PARENT] = path


def _lock_path(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserInputError(f"--run-dir {run_dir}: cannot create it ({err.strerror})") from None
    return run_dir.resolve() / LOCK_FILE


def _holder(fd: int) -> str:
    """Who holds the lock, from its file: "pid 123 on host-a since ...". The holder writes it
    just after locking, so a refusal in between reads nothing yet."""
    for _ in range(20):
        try:
            record = json.loads(os.pread(fd, 4096, 0))
            return f"pid {record['pid']} on {record['host']} since {record['since']}"
        except (ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return "holder not recorded"


def release_all() -> None:
    """Release every lock this process holds (the end of a command run in-process)."""
    for path, fd in list(_held.items()):
        os.close(fd)  # closing the last descriptor of the open file releases the flock
        del _held[path]
        if os.environ.get(HELD_BY_PARENT) == path:
            del os.environ[HELD_BY_PARENT]


@contextlib.contextmanager
def released_at_exit():
    """Around a command: whatever run dir it locked is unlocked when it returns."""
    try:
        yield
    finally:
        release_all()
