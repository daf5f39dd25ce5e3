"""`trainspec train --framework torch`: learns, writes records that validate against
trainspec/core/metrics.schema.json, resumes after kill -9 bit for bit, resumes on another world
size, and refuses what it cannot do with one line and exit 2."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from run_dirs import recorded_losses, signal_when, snapshot
from trainspec.core.records import json_schema
from tiny import TINY, tiny_spec
from cli_runs import read_records, read_summary, run_cli, start_cli, train_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
SETS = [*TINY, "metrics.interval=1", "checkpoint.interval=4", "checkpoint.keep=2"]


def _cmd(run_dir, *extra, nprocs=2, steps=STEPS):
    return train_command(run_dir, SETS, *extra, steps=steps, framework="torch", nprocs=nprocs)


def _has_record_past(run_dir, step) -> bool:
    return max(recorded_losses(run_dir), default=0) > step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("torch_ref")
    result = run_cli(_cmd(run_dir))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return run_dir


def test_learns_and_summarises(reference):
    summary = read_summary(reference)
    assert summary["framework"] == "torch" and summary["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
    assert summary["final_loss"] < summary["initial_loss"] - 0.3, summary
    assert summary["last_checkpoint"] == STEPS
    assert sorted(recorded_losses(reference)) == list(range(1, STEPS + 1))
    # the noise scale over the 2 data replicas, smoothed as the JAX loop smooths it
    records = read_records(reference)
    assert {r["gns_source"] for r in records} == {"replicas"}
    assert all(r["gns_trace"] > 0 and r["gns_grad_sq"] is not None for r in records)
    assert summary["gns"] == records[-1]["gns"] > 0 and summary["gns_not_measured"] is None


def test_records_count_the_gradient_all_reduce(reference):
    """Data parallel: one all-reduce of the float32 gradient (P) on `data` per step, plus the
    step's few scalars (docs/metrics.md section 5, trainspec/torch/comm.py)."""
    from trainspec.torch.models.transformer import Transformer

    p = 4 * sum(x.numel() for x in Transformer(tiny_spec().model).parameters())
    for record in read_records(reference):
        assert list(record["comm_bytes_by_kind"]) == ["all-reduce"]
        assert p <= record["comm_bytes_by_axis"]["data"] <= p + 64
        assert record["comm_bus_bytes_per_step"] == record["comm_bytes_per_step"]  # 2(n-1)/n = 1


def test_records_validate_against_the_schema(reference):
    schema = json_schema()
    for record in read_records(reference):
        jsonschema.validate(record, schema)


def test_records_carry_the_learning_rate_and_mark_the_checkpoints(reference):
    from trainspec.core.reference_train import learning_rate
    from trainspec.core.spec import load_spec

    optimizer = load_spec(reference / "spec.toml").optimizer  # the spec the run saved
    records = read_records(reference)
    assert [r["learning_rate"] for r in records] == [
        learning_rate(optimizer, STEPS, r["step"] - 1) for r in records]  # no step was skipped
    assert len({r["learning_rate"] for r in records}) > STEPS // 2  # warm-up, then decay
    assert [r["step"] for r in records if r.get("checkpoint_saved")] == [4, 8, 12]
    assert not any("resumed_from_step" in r for r in records)


def test_kill_9_then_resume_matches_uninterrupted(tmp_path, reference):
    proc = start_cli(_cmd(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    # Killed once step 5's record is written and checkpoint 4 is complete (written in the
    # background), somewhere in the following steps or the next save; the run must still be
    # going, or nothing is tested.
    deadline = time.time() + 300
    while not (_has_record_past(tmp_path, 4) and (tmp_path / "checkpoints" / "4").is_dir()) \
            and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank at once
    proc.wait()
    result = run_cli(_cmd(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = read_summary(tmp_path)
    assert summary["resumed_from"] >= 4 and "resumed from step" in result.stderr + result.stdout
    assert recorded_losses(tmp_path) == recorded_losses(reference)  # bit for bit, every step


def test_sigterm_checkpoints_the_same_step_on_every_rank_and_resumes_bitwise(tmp_path, reference):
    """SIGTERM to the job: the launcher forwards it to every rank, the ranks agree on the step
    to stop after, checkpoint it and exit 143 with one line saying where; the rerun loses no
    step and matches the uninterrupted run bit for bit."""
    # the steps after 6 take 0.3 s more on rank 0 (a sleep: no number changes), so the signal,
    # sent once step 6 is recorded, lands before the run's end on a fast machine too
    slower = {**os.environ,
              "TRAINSPEC_FAULTS": '{"delay_s": 0.3, "delay_steps": [7, 8, 9, 10, 11]}'}
    proc = start_cli(_cmd(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     start_new_session=True, env=slower)
    out, _ = signal_when(proc, lambda: _has_record_past(tmp_path, 5))
    assert proc.returncode == 143, out
    stopped_at = max(recorded_losses(tmp_path))
    assert stopped_at < STEPS, "the run ended before the signal: nothing is tested"
    assert (f"trainspec: stopped: SIGTERM after step {stopped_at}; checkpoint {stopped_at} is "
            "in ") in out, out
    assert (tmp_path / "checkpoints" / str(stopped_at) / "manifest.json").is_file()
    result = run_cli(_cmd(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert read_summary(tmp_path)["resumed_from"] == stopped_at
    assert recorded_losses(tmp_path) == recorded_losses(reference)


def test_restart_sets_the_checkpoints_aside_and_trains_from_step_0(tmp_path, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    result = run_cli(_cmd(run_dir, "--restart", steps=4))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = read_summary(run_dir)
    assert summary["resumed_from"] == 0 and "resumed from" not in result.stdout + result.stderr
    assert sorted(int(p.name) for p in (run_dir / "checkpoints-quarantine").iterdir()) == [8, 12]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["4"]
    # Trained afresh: the reference's first losses (a 4-step schedule's first 3 updates, which
    # the losses up to step 4 depend on, are the 12-step one's: warm-up, then the decay's start)
    want = recorded_losses(reference)
    assert recorded_losses(run_dir) == {step: want[step] for step in range(1, 5)}


def test_a_users_model_trains_and_resumes_through_the_command(tmp_path):
    """`--model examples/own_torch_model.py:make`: a user's nn.Module, loss, data and optimizer
    through trainspec.torch.wrap in the same loop; a rerun to a later step resumes it on
    another layout (data=2 -> fsdp=2), its records follow the schema."""
    model = ["--model", f"{ROOT / 'examples' / 'own_torch_model.py'}:make",
             "--set", "batch.micro_batch=8", "--set", "eval.interval=4"]
    result = run_cli(_cmd(tmp_path, *model, steps=4))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "trained 4 steps on mesh data=2 x fsdp=1 x tensor=1 (2 micro-batches" in result.stdout
    fsdp = ["--set", "mesh.axes.data.size=1", "--set", "mesh.axes.fsdp.size=2"]
    result = run_cli(_cmd(tmp_path, *model, *fsdp, steps=8))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert ("resumed from step 4 (mesh data=2 x fsdp=1 x tensor=1 → data=1 x fsdp=2 x tensor=1)"
            in result.stdout + result.stderr)
    records = read_records(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 9))
    schema = json_schema()
    for record in records:
        jsonschema.validate(record, schema)
    summary = read_summary(tmp_path)
    assert summary["final_loss"] < summary["initial_loss"] and summary["framework"] == "torch"
    assert records[-1]["model_flops_per_step"] == 6 * (8 * 32 + 32) * 16  # the model's own
    assert {r["batch_tokens"] for r in records} == {16}  # its rows: no sequence, no seq_len
    assert {r["learning_rate"] for r in records} == {3e-2}  # its optimizer's own, as on JAX
    # [eval]: the model's eval_batches after steps 4 and 8, in both invocations
    evaluated = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evaluated) == [4, 8] and 0 < evaluated[8] < evaluated[4], evaluated
    assert summary["eval_loss"] == evaluated[8]


def test_resumes_on_another_world_size(tmp_path, reference):
    """The reference run's step-8 checkpoint (2 ranks) continues on 4 ranks: the saved blocks
    reshard onto the new layout, the data position carries on; the losses follow the
    uninterrupted run's."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / str(STEPS))
    result = run_cli(_cmd(run_dir, nprocs=4))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = read_summary(run_dir)
    assert summary["resumed_from"] == 8 and summary["mesh"]["data"] == 4
    assert "resumed from step 8 (mesh data=2 x fsdp=1 x tensor=1 → data=4 x fsdp=1 x tensor=1)" \
        in result.stderr + result.stdout
    first = next(r for r in read_records(run_dir) if r["step"] == 9)
    assert (first["resumed_from_step"], first["resumed_from_mesh"]) == (8, "data=2 x fsdp=1 x tensor=1")
    want, got = recorded_losses(reference), recorded_losses(run_dir)
    resumed = range(9, STEPS + 1)
    np.testing.assert_allclose([got[s] for s in resumed], [want[s] for s in resumed], rtol=1e-5)


def test_a_rerun_to_an_earlier_step_trains_nothing_and_changes_nothing(tmp_path, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = snapshot(run_dir)
    result = run_cli(_cmd(run_dir, steps=6))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (f"trainspec: {run_dir} is already at step {STEPS} (its newest good checkpoint); "
            "asked to train to step 6: nothing trained, nothing changed") in result.stdout
    assert "trained 6 steps" not in result.stdout and snapshot(run_dir) == before


def test_a_corrupted_replica_is_found_and_halts(tmp_path):
    """A bit flipped in rank 1's copy of a parameter: the fingerprint vote over the 3 data
    replicas names rank 1, and the job stops with exit 3 and one line (said once, not once
    per rank), under `health.fingerprints.policy = "halt"`."""
    env = {**os.environ, "TRAINSPEC_FAULTS": '{"bitflip": [2, 1]}'}
    sets = ["--set", "batch.global_batch=12", "--set", "batch.micro_batch=12",
            "--set", "health.fingerprints.interval=1", "--set", "health.fingerprints.policy=halt"]
    result = run_cli(_cmd(tmp_path, *sets, nprocs=3, steps=4), env=env)
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.count("halted: replica fingerprints differ after step 2: embedding on "
                               "ranks [1]") == 1, result.stdout


def test_a_run_dir_of_the_other_framework_is_refused_by_name(tmp_path, reference, capsys):
    """Each framework refuses the other's checkpoints in one line naming it (not as bad
    checkpoints, not with orbax's warnings), before anything in the run dir changes; `advise`
    reads the spec and the records either framework saved."""
    from trainspec.cli.main import main
    from trainspec.jax.train import run

    torch_dir = tmp_path / "torch_run"
    shutil.copytree(reference, torch_dir)
    before = snapshot(torch_dir)
    assert main(["train", "--quiet", "--steps", str(STEPS + 2), "--run-dir", str(torch_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("trainspec: spec: ") for line in err[:-1]), err
    assert err[-1] == (f"trainspec: error: checkpoint.dir: {torch_dir}/checkpoints/{STEPS} is a "
                       "checkpoint of the torch implementation; resume it with --framework "
                       "torch, or give this run another --run-dir")
    assert snapshot(torch_dir) == before
    # advise reads the records, not the checkpoints: torch's carry the noise scale
    assert main(["advise", str(torch_dir)]) == 0
    assert "GNS from replicas" in capsys.readouterr().out

    jax_dir = tmp_path / "jax_run"
    run(tiny_spec("checkpoint.interval=2", "checkpoint.async_save=false"), jax_dir, steps=2,
        progress=False)
    before = snapshot(jax_dir)
    result = run_cli(_cmd(jax_dir))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].endswith(
        "checkpoints/2 is a checkpoint of the jax implementation; resume it with --framework "
        "jax, or give this run another --run-dir") and "[rank" not in result.stdout, result.stdout
    assert snapshot(jax_dir) == before


@pytest.mark.parametrize("extra,field", [
    (["--set", "layout.rules.embed=[]"], "layout.rules"),
    (["--set", "mesh.axes.tensor.size=2", "--set", "model.n_heads=3", "--set", "model.d_model=33"],
     "model.n_heads"),
    (["--set", "mesh.axes.data.size=3"], "mesh.axes"),
    (["--exclude-devices", "7"], "mesh.exclude_devices"),  # 2 ranks: no rank 7
    (["--set", "collectives.backend=ext"], "collectives.backend"),
    # one replica (fsdp over both ranks), one micro-batch: no second batch size to measure with
    (["--set", "mesh.axes.data.size=1", "--set", "mesh.axes.fsdp.size=-1", "--set",
      "metrics.gns=true"], "metrics.gns"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, extra, field):
    result = run_cli(_cmd(tmp_path, *extra))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any rank started
