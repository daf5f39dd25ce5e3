"""A run directory across invocations: every record's learning rate, the marks
of resumes and checkpoints, the line a resume prints, the spec the run dir keeps and reuses,
and a rerun asking for a step the run is already past (nothing trained, nothing changed)."""
import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from trainspec.cli.main import main
from trainspec.core.records import json_schema, read_jsonl
from trainspec.core.spec import load_spec
from trainspec.core.spec_source import to_toml
from trainspec.core.run_files import AlreadyTrained
from trainspec.jax.train import make_schedule, run

from run_dirs import snapshot
from tiny import TINY, tiny_spec

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json_schema()
STEPS = 4
SETS = ["checkpoint.interval=3", "checkpoint.async_save=false"]  # TINY records every 2 steps


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("first")
    spec = tiny_spec(*SETS, layout="data")
    run(spec, run_dir, steps=STEPS, progress=False)
    return spec, run_dir


def test_records_carry_the_learning_rate_and_mark_the_checkpoints(first_run):
    spec, run_dir = first_run
    records = read_jsonl(run_dir)
    for record in records:
        jsonschema.validate(record, SCHEMA)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # 3: a checkpoint off the interval
    schedule = make_schedule(spec, STEPS)
    assert [r["learning_rate"] for r in records] == [float(schedule(s - 1)) for s in (1, 2, 3, 4)]
    assert len({r["learning_rate"] for r in records}) == 4  # warm-up 0, lr/2, lr, then decay
    assert [r["step"] for r in records if r.get("checkpoint_saved")] == [3, 4]
    assert not any("resumed_from_step" in r or "resumed_from_mesh" in r for r in records)


def test_the_run_dir_keeps_the_spec_it_was_trained_under(first_run):
    spec, run_dir = first_run
    assert load_spec(run_dir / "spec.toml") == spec


def test_spec_toml_reads_back_for_every_example():
    for path in [ROOT / "trainspec" / "default.toml", *sorted((ROOT / "examples").glob("*.toml"))]:
        spec = load_spec(path)
        assert load_spec(to_toml(spec.to_dict())) == spec, path


def test_a_resume_on_another_mesh_is_said_and_marked(first_run, tmp_path):
    spec, saved = first_run
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    said = []
    run(tiny_spec(*SETS, layout="fsdp2"), run_dir, steps=6, progress=False, announce=said.append)
    assert said == ["resumed from step 4 (mesh data=8 x fsdp=1 x tensor=1 → "
                    "data=4 x fsdp=2 x tensor=1)"]
    records = {r["step"]: r for r in read_jsonl(run_dir)}
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    assert (records[5]["resumed_from_step"], records[5]["resumed_from_mesh"]) == (
        4, "data=8 x fsdp=1 x tensor=1")
    assert "resumed_from_step" not in records[6] and records[6]["checkpoint_saved"] is True
    schedule = make_schedule(spec, STEPS)  # a resume keeps the run's schedule (its length)
    assert [records[s]["learning_rate"] for s in (5, 6)] == [float(schedule(4)), float(schedule(5))]


def test_a_run_already_past_the_step_trains_nothing_and_changes_nothing(first_run):
    spec, run_dir = first_run
    before = snapshot(run_dir)
    with pytest.raises(AlreadyTrained, match=r"already at step 4 \(its newest good checkpoint\); "
                       r"asked to train to step 2: nothing trained, nothing changed"):
        run(spec, run_dir, steps=2, progress=False)
    assert snapshot(run_dir) == before


def _train(capsys, *argv) -> tuple[int, str, str]:
    code = main(["train", "--quiet", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_readme_resume_continues_on_the_spec_the_run_dir_was_trained_under(tmp_path, capsys):
    """README: `--spec examples/fsdp.toml --run-dir runs/fsdp`, then the same run dir without
    --spec continues on fsdp=8 (not the default spec's data=8); an explicit --spec still wins;
    a rerun to an earlier step says so in one line, exit 0, and prints no summary."""
    run_dir, summary = tmp_path / "fsdp", tmp_path / "s.json"
    tiny = [a for s in TINY for a in ("--set", s)]
    code, _, err = _train(capsys, "--spec", str(ROOT / "examples" / "fsdp.toml"), *tiny,
                          "--steps", "2", "--run-dir", str(run_dir))
    assert code == 0, err
    code, out, err = _train(capsys, "--run-dir", str(run_dir), "--steps", "4",
                            "--summary-json", str(summary))
    assert code == 0, err
    assert err.splitlines() == [
        f"trainspec: spec: {run_dir / 'spec.toml'}, the one this run dir was trained under "
        "(--spec chooses another)",
        # more steps than the checkpoints were planned for: the schedule is theirs, said once
        "trainspec: --steps 4: the checkpoints were planned for 2 steps; the spec's "
        "learning-rate schedule stays theirs and holds its floor after step 2 (--restart plans "
        "it over 4)",
        "trainspec: resumed from step 2 (mesh data=1 x fsdp=8 → data=1 x fsdp=8, unchanged)"]
    assert json.loads(summary.read_text())["mesh"] == {"data": 1, "fsdp": 8}
    # this call's steps and where the run is: not "trained 4 steps" after training 2
    assert "trained 2 steps (resumed at step 2, the run is at step 4) on mesh data=1 x fsdp=8" in out

    summary.unlink()
    code, out, err = _train(capsys, "--run-dir", str(run_dir), "--steps", "3",
                            "--summary-json", str(summary))
    assert (code, out) == (0, "") and not summary.exists()
    assert err.splitlines()[-1] == (
        f"trainspec: {run_dir} is already at step 4 (its newest good checkpoint); asked to "
        "train to step 3: nothing trained, nothing changed")

    code, out, err = _train(capsys, "--spec", str(ROOT / "trainspec" / "default.toml"), *tiny,
                            "--run-dir", str(run_dir), "--steps", "5",
                            "--summary-json", str(summary))
    assert code == 0, err
    assert "resumed from step 4 (mesh data=1 x fsdp=8 → data=8 x fsdp=1 x tensor=1)" in err
    assert json.loads(summary.read_text())["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
