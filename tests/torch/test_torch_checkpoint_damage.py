"""Torch checkpoints under damage and attack get the trunk's guarantees (trainspec.core.store),
as JAX's do: every damage to the newest checkpoint is found before anything is read, the step is
quarantined and the run resumes from the previous one bit for bit; when none is good, or the
spec cannot resume them, the job stops with one line and exit 2 from one process; metrics.jsonl
never loses a record; a planted pickle is never run. One trained run of 2 gloo ranks, copied
per case."""
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from cli_runs import read_summary, run_cli, train_command
from run_dirs import recorded_losses, snapshot
from tiny import TINY
from trainspec.core.store import MANIFEST, file_digest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
SETS = [*TINY, "metrics.interval=1", "checkpoint.interval=2", "checkpoint.keep=3",
        "checkpoint.async_save=false"]
RANK_FILES = ("rank-00000.safetensors", "rank-00001.safetensors")


def _cmd(run_dir, *extra, steps=STEPS):
    return train_command(run_dir, SETS, *extra, steps=steps, framework="torch", nprocs=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints 2 and 4 of a finished run, and its 4 records."""
    run_dir = tmp_path_factory.mktemp("torch_trained")
    result = run_cli(_cmd(run_dir))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]
    assert sorted(os.listdir(run_dir / "checkpoints" / "4")) == [MANIFEST, *RANK_FILES]
    return run_dir


@pytest.fixture
def run_dir(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _history(run_dir: Path) -> dict:
    """The records and checkpoints a refused start must leave as they were (the run dir's lock,
    taken by whoever starts, may change)."""
    return {path: stamp for path, stamp in snapshot(run_dir).items()
            if path == "metrics.jsonl" or path.startswith("checkpoints")}


def _rewrite(path: Path, edit) -> None:
    path.write_bytes(edit(bytearray(path.read_bytes())))


def _flip(data: bytearray) -> bytes:
    data[-5] ^= 0x10  # in the last tensor's values, past the header
    return bytes(data)


def _garbage(data: bytearray) -> bytes:
    middle = len(data) // 2
    data[middle:middle + 256] = os.urandom(256)
    return bytes(data)


def _newest(run_dir: Path, name: str = RANK_FILES[1]) -> Path:
    return run_dir / "checkpoints" / "4" / name


RESUMABLE = {
    "bit_flip": lambda d: _rewrite(_newest(d), _flip),
    "truncated": lambda d: _rewrite(_newest(d), lambda b: bytes(b[:100])),
    "garbage": lambda d: _rewrite(_newest(d), _garbage),
    "rank_file_removed": lambda d: _newest(d, RANK_FILES[0]).unlink(),
    "manifest_removed": lambda d: _newest(d, MANIFEST).unlink(),
    "garbage_manifest": lambda d: _newest(d, MANIFEST).write_text('{"format": '),
    "empty_newest_dir": lambda d: [p.unlink() for p in _newest(d).parent.iterdir()],
}


@pytest.mark.parametrize("damage", RESUMABLE, ids=str)
def test_a_damaged_newest_checkpoint_is_quarantined_and_the_run_resumes_bitwise(
        run_dir, trained, damage):
    RESUMABLE[damage](run_dir)
    result = run_cli(_cmd(run_dir))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    assert out.count("checkpoint 4 is bad (") == 1, out  # one line, from one process
    assert read_summary(run_dir)["resumed_from"] == 2
    assert recorded_losses(run_dir) == recorded_losses(trained)  # steps 3 and 4 again, bitwise
    assert (run_dir / "checkpoints-quarantine" / "4").is_dir()
    assert sorted(os.listdir(run_dir / "checkpoints" / "4")) == [MANIFEST, *RANK_FILES]


def _garble_all(run_dir: Path) -> None:
    for step in ("2", "4"):
        _rewrite(run_dir / "checkpoints" / step / RANK_FILES[0], _garbage)


REFUSED = {
    "all_checkpoints_bad": (_garble_all, "all 2 checkpoints in"),
    "checkpoints_a_regular_file": (
        lambda d: (shutil.rmtree(d / "checkpoints"), (d / "checkpoints").write_text("")),
        "checkpoints exists and is not a directory"),
    "seed_changed": (lambda d: None, "seed: the checkpoints in"),
    "batch_changed": (lambda d: None, "batch.global_batch: the checkpoints in"),
}
CHANGES = {"seed_changed": ["--set", "seed=7"],
           "batch_changed": ["--set", "batch.global_batch=8", "--set", "batch.micro_batch=8"]}


@pytest.mark.parametrize("case", REFUSED, ids=str)
def test_no_resumable_checkpoint_is_one_line_exit_2_and_nothing_changes(run_dir, case):
    damage, message = REFUSED[case]
    damage(run_dir)
    before = _history(run_dir)
    result = run_cli(_cmd(run_dir, *CHANGES.get(case, ()), steps=STEPS + 2))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    # one error line; before it at most the note that the run dir's saved spec is used
    assert all(line.startswith("trainspec: spec: ") for line in lines[:-1]) and len(lines) <= 2
    assert message in lines[-1] and "[rank" not in result.stdout + result.stderr, \
        result.stdout + result.stderr
    assert _history(run_dir) == before and "metrics.jsonl" in before


def _ranks_alone(run_dir, *extra, steps=STEPS):
    """The ranks started by a plain launcher (as torchrun starts them): nothing looked at the
    checkpoints before they did."""
    train = _cmd(run_dir, *extra, steps=steps)
    i = train.index("--nprocs")
    return [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", "2", "--",
            *train[:i], *train[i + 2:]]


def test_ranks_on_their_own_fall_back_alike_and_say_it_once(run_dir, trained):
    RESUMABLE["bit_flip"](run_dir)
    result = run_cli(_ranks_alone(run_dir))
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert out.count("checkpoint 4 is bad (the SHA-256 of rank-00001.safetensors") == 1, out
    assert recorded_losses(run_dir) == recorded_losses(trained)


@pytest.mark.parametrize("case", REFUSED, ids=str)
def test_ranks_on_their_own_refuse_alike_and_say_it_once(run_dir, case):
    damage, message = REFUSED[case]
    damage(run_dir)
    before = _history(run_dir)
    result = run_cli(_ranks_alone(run_dir, *CHANGES.get(case, ()), steps=STEPS + 2))
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert out.count(message) == 1, out
    assert _history(run_dir) == before and "metrics.jsonl" in before


class Payload:
    """Unpickling it writes a file: what a planted DCP `.metadata` would do to FileSystemReader."""

    def __init__(self, proof: Path):
        self.proof = proof

    def __reduce__(self):
        return (Path.write_text, (self.proof, "ran"))


def test_a_planted_pickle_is_never_run(run_dir, tmp_path):
    """Planted as DCP's `.metadata` and listed in the manifest with its true hash (as an
    attacker with write access would): the step verifies, and is resumed from, yet nothing in
    it is unpickled."""
    proof = tmp_path / "pwned"
    planted = _newest(run_dir, ".metadata")
    planted.write_bytes(pickle.dumps(Payload(proof)))
    manifest = json.loads(_newest(run_dir, MANIFEST).read_text())
    manifest["files"][".metadata"] = file_digest(planted)
    _newest(run_dir, MANIFEST).write_text(json.dumps(manifest))
    result = run_cli(_cmd(run_dir, steps=STEPS + 1))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert read_summary(run_dir)["resumed_from"] == STEPS
    assert not proof.exists()
    pickle.loads(planted.read_bytes())  # the payload is live: here, it runs
    assert proof.read_text() == "ran"


def test_no_run_dir_file_is_read_with_pickle():
    """The package reads its checkpoints, records and specs without pickle or torch.load."""
    root = ROOT / "trainspec"
    found = [f"{p.relative_to(root)}: {word}" for p in sorted(root.rglob("*.py"))
             for word in ("import pickle", "torch.load(", "FileSystemReader(", "weights_only=False",
                          "dcp.load(", "allow_pickle=True")
             if word in p.read_text()]
    assert found == []
