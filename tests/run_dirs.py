"""What a run directory holds, to show that a command changed nothing in it; its losses while
a writer runs or after it was killed; a signal to a training command once its run directory
shows it got far enough."""
import hashlib
import signal
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from trainspec.core.records import read_jsonl


def snapshot(run_dir: Path) -> dict:
    """Every path under `run_dir` with its modification time and, for files, content hash."""
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, hashlib.sha256(
        p.read_bytes()).hexdigest() if p.is_file() else None) for p in run_dir.rglob("*")}


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
