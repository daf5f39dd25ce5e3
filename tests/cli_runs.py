"""`trainspec train` as a user runs it, in a process of its own: its command line, running it,
and reading back what it left in its run directory.

Every process runs in its run directory's parent (a pytest tmp_path), never in the checkout: a
relative path the CLI writes lands beside the run, not in the repository."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from xla_env import without_device_count


def set_flags(sets) -> list[str]:
    """`--set FIELD=VALUE` for each override."""
    return [arg for item in sets for arg in ("--set", item)]


def train_command(run_dir: Path, sets=(), *extra: str, steps: int, framework: str | None = None,
                  nprocs: int | None = None, summary: bool = True) -> list[str]:
    """`python -m trainspec.cli.main train --quiet` for `steps` steps into `run_dir`, its summary
    in run_dir/summary.json unless `summary` is false; `extra` goes last."""
    cmd = [sys.executable, "-m", "trainspec.cli.main", "train"]
    if framework:
        cmd += ["--framework", framework]
    if nprocs is not None:
        cmd += ["--nprocs", str(nprocs)]
    cmd += ["--quiet", "--steps", str(steps), "--run-dir", str(run_dir)]
    if summary:
        cmd += ["--summary-json", str(Path(run_dir) / "summary.json")]
    return [*cmd, *set_flags(sets), *extra]


def cli_env() -> dict:
    """A JAX run's environment as a user's shell gives it: the suite's 8 forced devices left out
    (the CLI chooses the device count), and no injected faults."""
    return {**without_device_count(), "TRAINSPEC_FAULTS": "{}"}


def run_dir_of(cmd: list[str]) -> Path:
    """The --run-dir of `cmd`."""
    return Path(cmd[cmd.index("--run-dir") + 1])


def scratch_dir(cmd: list[str]) -> Path:
    """Where `cmd` runs: its run directory's parent."""
    return run_dir_of(cmd).parent


def start_cli(cmd: list[str], **popen) -> subprocess.Popen:
    """`cmd` started in its scratch directory (Popen's own keyword arguments pass through)."""
    return subprocess.Popen(cmd, cwd=scratch_dir(cmd), **popen)


def run_cli(cmd: list[str], env: dict | None = None, timeout: float = 600,
        ) -> subprocess.CompletedProcess:
    """`cmd` run to its end in its scratch directory, its output captured; whatever its status."""
    return subprocess.run(cmd, capture_output=True, text=True, cwd=scratch_dir(cmd), env=env,
                          timeout=timeout)


def run_cli_ok(cmd: list[str], env: dict | None = None, timeout: float = 600) -> str:
    """`cmd` run to its end; fails the test, with the output's tails, unless it exits 0. Its
    stdout and stderr together."""
    result = run_cli(cmd, env=env, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def read_records(run_dir: Path) -> list[dict]:
    """Every line of the run's metrics.jsonl, parsed, in file order (no line skipped)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def trained_trajectory(run_dir: Path, sets, *extra: str, steps: int,
                       keys=("loss", "grad_norm")) -> dict:
    """`trainspec train` for `steps` steps into `run_dir` (every step recorded: the sets must
    say metrics.interval=1); each of `keys` per step as a NumPy array."""
    import numpy as np

    run_cli_ok(train_command(run_dir, sets, *extra, steps=steps, summary=False))
    records = read_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return {key: np.array([r[key] for r in records]) for key in keys}


def read_summary(run_dir: Path) -> dict:
    """The run's --summary-json."""
    return json.loads((Path(run_dir) / "summary.json").read_text())


def complete_checkpoints(run_dir: Path) -> list[int]:
    """The steps of the run's complete checkpoints (a numbered directory; a save in progress is
    N.partial), oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []


def kill_9_after_first_checkpoint(cmd: list[str], env: dict | None = None) -> list[int]:
    """Start `cmd` and SIGKILL it right after its first checkpoint is complete; the complete
    checkpoints then. Fails the test when the run ended first or died before any checkpoint:
    the kill would test nothing."""
    run_dir = run_dir_of(cmd)
    proc = start_cli(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while not complete_checkpoints(run_dir) and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the kill: the test tests nothing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    complete = complete_checkpoints(run_dir)
    assert complete, "the kill came before any checkpoint: the test tests nothing"
    return complete
