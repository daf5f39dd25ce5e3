"""A disk that fills during a run, on both frameworks: one line, exit 2, no traceback, the
metrics file holding whole records only, the newest good checkpoint kept.

The disk is a real 3 MiB tmpfs where this process may mount one (root), else the metrics
writer's `os.write` fails as a full disk's does from the third record on (half the line
written, then ENOSPC), in every process of the job (a sitecustomize on PYTHONPATH)."""
import json
import subprocess

import pytest

from cli_runs import run_cli, train_command
from tiny import TINY
from xla_env import without_device_count

FULL_DISK_SITE = """
import errno, os
from trainspec.core import records

class FullDiskFromTheThirdRecord:
    writes = 0
    def __getattr__(self, name):
        return getattr(os, name)
    def write(self, fd, data):
        FullDiskFromTheThirdRecord.writes += 1
        if FullDiskFromTheThirdRecord.writes < 3:
            return os.write(fd, data)
        os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

records.os = FullDiskFromTheThirdRecord()
"""


def _train(framework, run_dir, steps):
    sets = [*TINY, "checkpoint.interval=2", "metrics.interval=1", "checkpoint.async_save=false"]
    return train_command(run_dir, sets, steps=steps, framework=framework,
                         nprocs=2 if framework == "torch" else None, summary=False)


def _check(result, run_dir):
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "trainspec: error:" in line]
    # the process that hit the full disk says so, as the OS says it, whichever framework
    # wrote (a checkpoint or a record); the ranks that then lost it as a peer add nothing
    assert len(errors) == 1 and "No space left on device" in errors[0], out
    lines = (run_dir / "metrics.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b""  # ends with a whole record
    assert all(json.loads(line)["step"] for line in lines[:-1])
    kept = [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert kept, "the newest good checkpoint is kept"


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_full_disk_is_one_line_and_tears_no_record(tmp_path, framework):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FULL_DISK_SITE)
    env = {**without_device_count(), "PYTHONPATH": str(site)}
    run_dir = tmp_path / "run"
    result = run_cli(_train(framework, run_dir, steps=6), env=env, timeout=300)
    _check(result, run_dir)
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_real_full_tmpfs_is_one_line_and_tears_no_record(small_tmpfs, framework):
    (small_tmpfs / "filler").write_bytes(bytes(2_000_000))  # about 1 MiB left
    run_dir = small_tmpfs / "run"
    result = run_cli(_train(framework, run_dir, steps=40), env=without_device_count(),
                     timeout=300)
    _check(result, run_dir)
