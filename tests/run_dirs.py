"""What a run directory holds, to show that a command changed nothing in it; a signal to a
training command once its run directory shows it got far enough."""
import hashlib
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def snapshot(run_dir: Path) -> dict:
    """Every path under `run_dir` with its modification time and, for files, content hash."""
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, hashlib.sha256(
        p.read_bytes()).hexdigest() if p.is_file() else None) for p in run_dir.rglob("*")}


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
