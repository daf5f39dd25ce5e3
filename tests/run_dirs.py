"""What a run directory holds, to show that a command changed nothing in it; its losses while
a writer runs or after it was killed; a signal to a training command once its run directory
shows it got far enough."""
import hashlib
import os
import re
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from trainspec.core.records import read_jsonl


# Who runs in the run dir now, not what it holds: the lock's holder record (rewritten by every
# run that takes it) and the processes' step marks (trainspec.core.run_lock, .arrivals).
BOOKKEEPING = ("run.lock", "ranks")


def snapshot(run_dir: Path) -> dict:
    """Every path under `run_dir` with its modification time and, for files, content hash;
    the lock and the step marks left out (BOOKKEEPING)."""
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, hashlib.sha256(
        p.read_bytes()).hexdigest() if p.is_file() else None) for p in run_dir.rglob("*")
        if p.relative_to(run_dir).parts[0] not in BOOKKEEPING}


def recorded_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of the complete records in the run's metrics.jsonl ({} before the first),
    read as the product reads them: `read_jsonl` skips a last line without its newline, one
    being written or torn by kill -9 (a write that crosses a page boundary stops short when
    SIGKILL arrives)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists() or b"\n" not in path.read_bytes():
        return {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is truncated")
        return {r["step"]: r["loss"] for r in read_jsonl(path)}


def signal_when(proc: subprocess.Popen, ready: Callable[[], bool],
                signum: int = signal.SIGTERM) -> tuple[str, str]:
    """Send `signum` to `proc` as soon as `ready()` (the process must still be running then);
    its (stdout, stderr) once it has exited."""
    deadline = time.time() + 300
    while not ready():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signum)
    return proc.communicate(timeout=120)


def stop_rank_when_recorded(job: subprocess.Popen, run_dir: Path, rank: int,
                            records: int = 2) -> tuple[int, float, str, dict[int, int]]:
    """SIGSTOP rank `rank` of a launched `job` (output piped, `[launch] rank R pid P` lines)
    once its run dir holds `records` metric records; (the job's exit status, seconds from the
    stop to its end, its output, {rank: pid})."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(job.stdout.readline, "")),
                              daemon=True)
    reader.start()
    metrics, deadline = Path(run_dir) / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= records):
        assert job.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
        time.sleep(0.1)
    pids = {int(m.group(1)): int(m.group(2)) for line in list(lines)
            if (m := re.match(r"\[launch\] rank (\d+) pid (\d+)", line))}
    t0 = time.monotonic()
    os.kill(pids[rank], signal.SIGSTOP)
    status = job.wait(timeout=600)
    elapsed = time.monotonic() - t0
    reader.join(timeout=5)
    return status, elapsed, "".join(lines), pids
