"""Ranks left out of a torch job (trainspec/torch/members.py), on gloo ranks:

- `health.fingerprints.policy = "rollback"`: a bit flipped in rank 0's replica after step 6 (4
  data replicas, fingerprints every step) is voted out; rank 0 leaves, rank 3 idles (16 rows do
  not split over 3 replicas), ranks 1 and 2 form a new job of data = 2, restore checkpoint 4
  onto it and train on: steps 5-12 are bit for bit those of the same checkpoint resumed on 2
  ranks, the first 4 those of the 4-rank run; the records are written by the new first rank;
- `--exclude-devices 1` on 3 ranks: rank 1 leaves at the start, ranks 0 and 2 train the 2-rank
  job's losses bit for bit;
- both on 5 ranks, `--exclude-devices 0` then a bit flipped in rank 2's replica: ranks are named
  as launched throughout (rank 2, now the job's second), ranks 1 and 3 go on.
"""
import os
import shutil

import pytest

from cli_runs import read_records, read_summary, run_cli_ok, train_command
from tiny import TINY

pytestmark = pytest.mark.slow  # six torch jobs: over a minute on 2 cores

STEPS = 12
SETS = [*TINY, "metrics.interval=1", "checkpoint.interval=4", "health.fingerprints.interval=1"]


def _run(run_dir, nprocs, *extra, env=None):
    cmd = train_command(run_dir, SETS, *extra, steps=STEPS, framework="torch", nprocs=nprocs)
    out = run_cli_ok(cmd, env={**os.environ, **(env or {})})
    return out, read_summary(run_dir)


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir)}


@pytest.fixture(scope="module")
def four_then_two(tmp_path_factory):
    """4 ranks to step 12; then from its checkpoint 4 on 2 ranks: losses by step of both."""
    run_dir = tmp_path_factory.mktemp("four")
    _run(run_dir, 4)
    four = _losses(run_dir)
    for later in ("8", "12"):
        shutil.rmtree(run_dir / "checkpoints" / later)
    _, summary = _run(run_dir, 2)
    assert summary["resumed_from"] == 4 and summary["mesh"]["data"] == 2
    return four, _losses(run_dir)


def test_a_diverged_replica_leaves_and_the_rest_roll_back_onto_a_smaller_mesh(
        tmp_path, four_then_two):
    four, two = four_then_two
    out, summary = _run(tmp_path, 4, env={"TRAINSPEC_FAULTS": '{"bitflip": [6, 0]}'})
    assert summary["rollbacks"] == [{
        "step": 6, "excluded": [0], "restored_step": 4,
        "reason": "replica fingerprints differ after step 6: embedding on ranks [0]"}]
    assert summary["excluded_devices"] == [0] and summary["mesh"]["data"] == 2
    assert "[rank 0] trainspec: rank 0 left the job (excluded; its replica diverged)" in out
    assert "[rank 3] trainspec: rank 3 left the job (idle: the mesh does not fit it" in out
    assert "[rank 1] trained 12 steps on mesh data=2" in out  # the job's first rank now
    losses = _losses(tmp_path)
    assert sorted(losses) == list(range(1, STEPS + 1))  # steps 5, 6 redone after the rollback
    assert {s: losses[s] for s in range(1, 5)} == {s: four[s] for s in range(1, 5)}
    assert {s: losses[s] for s in range(5, STEPS + 1)} == {s: two[s] for s in range(5, STEPS + 1)}


def test_excluded_ranks_leave_at_the_start(tmp_path, four_then_two):
    out, summary = _run(tmp_path, 3, "--exclude-devices", "1")
    assert "[rank 1] trainspec: rank 1 left the job (excluded; mesh.exclude_devices)" in out
    assert summary["excluded_devices"] == [1] and summary["mesh"]["data"] == 2
    two_ranks = tmp_path / "two"
    _run(two_ranks, 2)
    assert _losses(tmp_path) == _losses(two_ranks)


def test_a_rollback_after_an_exclusion_names_ranks_as_launched(tmp_path, four_then_two):
    four, two = four_then_two
    out, summary = _run(tmp_path, 5, "--exclude-devices", "0",
                        env={"TRAINSPEC_FAULTS": '{"bitflip": [6, 2]}'})
    assert summary["rollbacks"] == [{
        "step": 6, "excluded": [2], "restored_step": 4,
        "reason": "replica fingerprints differ after step 6: embedding on ranks [2]"}]
    assert summary["excluded_devices"] == [0, 2] and summary["mesh"]["data"] == 2
    assert "[rank 4] trainspec: rank 4 left the job (idle: the mesh does not fit it" in out
    assert "[rank 1] trained 12 steps on mesh data=2" in out
    losses = _losses(tmp_path)
    assert {s: losses[s] for s in range(1, 5)} == {s: four[s] for s in range(1, 5)}
    assert {s: losses[s] for s in range(5, STEPS + 1)} == {s: two[s] for s in range(5, STEPS + 1)}
