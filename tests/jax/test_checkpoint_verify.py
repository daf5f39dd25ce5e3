"""Checkpoints are verified on restore: a corrupted one is detected, set aside and re-trained;
when every one is bad the run stops with one line; the summary names only good checkpoints."""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from trainspec.jax.checkpoint import Checkpointer
from trainspec.cli.main import main
from trainspec.core.store import MANIFEST
from trainspec.jax.train import build_job, run

from tiny import TINY, tiny_spec

SPEC = ["checkpoint.interval=2", "checkpoint.keep=3", "checkpoint.async_save=false"]
STEPS = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run with checkpoints 2 and 4, copied afresh by each test."""
    run_dir = tmp_path_factory.mktemp("trained")
    run(tiny_spec(*SPEC), run_dir, steps=STEPS, progress=False)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "4"]
    return run_dir


@pytest.fixture
def run_dir(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _data_files(step_dir: Path) -> list[Path]:
    """The state's OCDBT data files (every `d/` folder). Which of their bytes a restore reads
    varies from run to run (orbax merges the per-process databases; values it copies into the
    merged tree, and superseded nodes, stay unread in the files), so each corruption below is
    spread over every file densely enough to hit bytes that are read: one damaged spot in the
    middle of the largest file sometimes damaged nothing a restore reads."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no OCDBT data files under {step_dir}"
    return files


STRIDE = 1024  # one damaged spot per KiB of every data file


def _flip_bit(step_dir: Path) -> None:
    """One flipped bit in each KiB."""
    for path in _data_files(step_dir):
        data = bytearray(path.read_bytes())
        for at in range(STRIDE // 2, len(data), STRIDE):
            data[at] ^= 0x10
        path.write_bytes(bytes(data))


def _garbage(step_dir: Path) -> None:
    """4 KiB of random bytes in the middle of each file and 64 B in each KiB elsewhere."""
    rng = np.random.default_rng(0)
    for path in _data_files(step_dir):
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 4096] = rng.bytes(len(data[middle:middle + 4096]))
        for at in range(0, len(data), STRIDE):
            data[at:at + 64] = rng.bytes(len(data[at:at + 64]))
        path.write_bytes(bytes(data))


def _truncate(step_dir: Path) -> None:
    """Each file cut to its first 64 bytes."""
    for path in _data_files(step_dir):
        path.write_bytes(path.read_bytes()[:64])


def _delete(step_dir: Path) -> None:
    for path in _data_files(step_dir):
        path.unlink()


def _wrong_checksum(step_dir: Path) -> None:
    """Files that verify, whose arrays are not the ones saved (what orbax writing or reading
    back wrong bytes looks like): the saved checksum of one array changed in the manifest."""
    manifest_path = step_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    leaf = sorted(manifest["meta"]["checksums"])[0]
    manifest["meta"]["checksums"][leaf] = "0" * 16
    manifest_path.write_text(json.dumps(manifest))


CORRUPTIONS = [_flip_bit, _garbage, _truncate, _delete, _wrong_checksum]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_a_bad_checkpoint_is_detected_and_set_aside(run_dir, corrupt, caplog):
    spec = tiny_spec(*SPEC)
    corrupt(run_dir / "checkpoints" / "4")
    ckpt = Checkpointer(spec, run_dir)
    state, meta = ckpt.restore_latest(build_job(spec, init=False).abstract_state)
    assert meta["step"] == 2 and ckpt.last_saved == 2
    lines = [r.getMessage() for r in caplog.records if "is bad" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("checkpoint 4 is bad (")
    assert (run_dir / "checkpoints-quarantine" / "4").is_dir()  # moved aside, not deleted
    assert ckpt.steps() == [2]


def test_a_fallback_retrains_and_replaces_the_bad_checkpoint(run_dir):
    _flip_bit(run_dir / "checkpoints" / "4")
    summary = run(tiny_spec(*SPEC), run_dir, steps=STEPS, progress=False)
    assert summary["resumed_from"] == 2 and summary["last_checkpoint"] == 4
    # the re-trained checkpoint 4 verifies; a longer run resumes from it, with no fallback
    again = run(tiny_spec(*SPEC), run_dir, steps=STEPS + 1, progress=False)
    assert again["resumed_from"] == 4 and not (run_dir / "checkpoints-quarantine" / "4.1").exists()


def test_the_command_names_the_checkpoint_it_set_aside_in_its_own_lines(run_dir, capsys):
    _flip_bit(run_dir / "checkpoints" / "4")
    assert main(["train", "--quiet", "--steps", str(STEPS), "--run-dir", str(run_dir),
                 *[a for s in TINY + SPEC for a in ("--set", s)]]) == 0
    err = capsys.readouterr().err
    assert "\ntrainspec: checkpoint 4 is bad (" in err and "WARNING" not in err, err


def test_all_bad_stops_with_one_line_and_keeps_them(run_dir, capsys):
    for step in ("2", "4"):
        _garbage(run_dir / "checkpoints" / step)
    records = (run_dir / "metrics.jsonl").read_text()
    argv = ["train", "--quiet", "--steps", str(STEPS), "--run-dir", str(run_dir),
            *[a for s in TINY + SPEC for a in ("--set", s)]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # one error line; before it at most the note that the run dir's saved spec is used
    assert all(line.startswith("trainspec: spec: ") for line in err[:-1]), err
    assert "all 2 checkpoints" in err[-1] and "--restart" in err[-1] and len(err) <= 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "4"]
    assert (run_dir / "metrics.jsonl").read_text() == records  # history untouched
    # starting over is explicit, and sets the bad ones aside rather than deleting them
    assert main(argv + ["--restart"]) == 0
    assert sorted(p.name for p in (run_dir / "checkpoints-quarantine").iterdir()) == ["2", "4"]
    summary_ckpt = Checkpointer(tiny_spec(*SPEC), run_dir)
    state, meta = summary_ckpt.restore_latest(build_job(tiny_spec(*SPEC), init=False).abstract_state)
    assert meta["step"] == STEPS
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
