"""What a run directory holds, to show that a command changed nothing in it."""
import hashlib
from pathlib import Path


def snapshot(run_dir: Path) -> dict:
    """Every path under `run_dir` with its modification time and, for files, content hash."""
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, hashlib.sha256(
        p.read_bytes()).hexdigest() if p.is_file() else None) for p in run_dir.rglob("*")}
