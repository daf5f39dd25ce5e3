"""A run that cannot go well stops at once with one line: an unwritable checkpoint directory,
a failing save, a batch or step that does not fit in memory."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from trainspec.core.errors import UserInputError
from trainspec.jax.health.memory import GIB, check_host_batch, check_step
from trainspec.jax.train import run

from cli_runs import cli_env, run_cli, start_cli, train_command
from tiny import TINY, tiny_spec

BOUND_S = 30  # a failed save ends the run within 30 s


def _train(run_dir, *sets, steps=4):
    return train_command(run_dir, [*TINY, *sets], steps=steps, summary=False)


def test_checkpoint_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "checkpoints").write_text("not a directory")
    t0 = time.monotonic()
    result = run_cli(_train(tmp_path), env=cli_env(), timeout=BOUND_S)
    print(f"exited after {time.monotonic() - t0:.1f} s")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"trainspec: error: checkpoint.dir: {tmp_path / 'checkpoints'} exists and is not a "
        "directory; move it away, or give this run another --run-dir"]


def _replace_with_a_file(directory):
    """Turn `directory` into an empty file while the run keeps saving into it. The run may
    recreate the directory between our delete and our create, so move it aside (atomic) and
    create the file exclusively, and go again if the run got there first."""
    for attempt in range(100):
        aside = directory.with_name(f"{directory.name}.aside{attempt}")
        try:
            directory.rename(aside)
        except FileNotFoundError:
            pass
        shutil.rmtree(aside, ignore_errors=True)
        try:
            directory.touch(exist_ok=False)
            return
        except FileExistsError:
            continue
    raise AssertionError(f"the run kept recreating {directory}")


def test_a_save_that_fails_mid_run_ends_it_with_one_line(tmp_path):
    """The checkpoint directory turns into a file after the first save: the next (background)
    save fails; the run ends with one line, exit 2, and does not hang at shutdown."""
    proc = start_cli(_train(tmp_path, "checkpoint.interval=2", "metrics.interval=1", steps=10000),
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=cli_env())
    checkpoints = tmp_path / "checkpoints"
    try:
        # Any saved step, not step 2 alone: a run that starts from a warm compilation cache
        # saves every few ms, and retention may delete step 2 between two looks.
        deadline = time.monotonic() + 300
        while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        _replace_with_a_file(checkpoints)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=BOUND_S)
    finally:
        proc.kill()  # on any failure above too: a 10000-step run must not outlive the test
    print(f"exited {time.monotonic() - t0:.1f} s after the directory was replaced")
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainspec: error: checkpoint.dir: saving to"), err


# `trainspec` with the metrics writer failing as on a full disk from step 3 on (ENOSPC, raised
# where the write reaches the file system; a tmpfs to fill needs root, CI has none).
FULL_DISK_FROM_STEP_3 = """
import errno, os, sys
from trainspec.core import records
write = records.JsonlWriter.write
def write_to_a_full_disk(self, record):
    if record["step"] >= 3:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    write(self, record)
records.JsonlWriter.write = write_to_a_full_disk
from trainspec.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_disk_that_fills_mid_run_is_one_line(tmp_path):
    """The disk fills after a checkpoint started in the background: one line, exit 2, no
    traceback and nothing from orbax's threads."""
    argv = _train(tmp_path, "checkpoint.interval=2", "metrics.interval=1", steps=6)
    result = run_cli([sys.executable, "-c", FULL_DISK_FROM_STEP_3, *argv[3:]], env=cli_env(),
                     timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"trainspec: error: --run-dir {tmp_path}: No space left on device"]


def test_a_full_disk_is_refused_before_training(tmp_path, capsys, monkeypatch):
    from trainspec.cli import train as train_cli
    from trainspec.cli.main import main

    monkeypatch.setattr(train_cli.os, "statvfs", lambda path: SimpleNamespace(f_bavail=0))
    assert main(["train", "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (
        f"trainspec: error: --run-dir {tmp_path / 'run'}: no space left on its file system\n")


def test_a_read_only_file_system_is_one_line(tmp_path, capsys, monkeypatch):
    """As the kernel answers on a read-only mount (simulated: CI runs as root, with no such
    mount): access(W_OK) fails for an existing run dir, mkdir raises EROFS for a new one."""
    import errno

    from trainspec.cli import train as train_cli
    from trainspec.cli.main import main

    monkeypatch.setattr(train_cli.os, "access", lambda path, mode: False)
    assert main(["train", "--run-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"trainspec: error: --run-dir {tmp_path} is not writable\n"

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["train", "--run-dir", str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err == (f"trainspec: error: --run-dir {tmp_path / 'new'}: cannot "
                                       "create it (Read-only file system)\n")


def test_a_batch_larger_than_the_host_is_refused_before_it_is_built(tmp_path):
    spec = tiny_spec("batch.global_batch=16777216", "batch.micro_batch=16", "batch.seq_len=4096")
    with pytest.raises(UserInputError, match=r"^batch.global_batch, batch.micro_batch, "
                       r"batch.seq_len .*: this process's share of the batch needs \d+\.\d+ GiB"):
        run(spec, tmp_path, steps=1, progress=False)


def test_memory_checks_compare_with_what_is_available():
    check_host_batch(GIB, available=2 * GIB)
    with pytest.raises(UserInputError, match="needs 2.00 GiB but 1.00 GiB"):
        check_host_batch(2 * GIB, available=GIB)
    step = {"memory_peak_bytes": 3 * GIB, "memory_argument_bytes": GIB}
    cpus = jax.local_devices()[:2]  # host devices: (peak - arguments) each, from host memory
    check_step(step, cpus, host_available=4 * GIB)
    with pytest.raises(UserInputError, match="compiled step's buffers on 2 host devices"):
        check_step(step, cpus, host_available=3 * GIB)
