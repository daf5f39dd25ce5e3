"""`trainspec train` as 2 processes x 4 CPU devices (jax.distributed over gloo, `trainspec launch`).

Each launched job pays process start-up and compilation (tens of seconds on 2 cores), so
the jobs are few, tiny (one layer, d_model 32) and short (8 steps).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file

from cli_runs import read_records, read_summary
from trainspec.core import params_file
from trainspec.core.errors import UserInputError
from trainspec.core.reference_train import initial_params, leaves
from trainspec.jax.mesh import check_hierarchical
from trainspec.core.spec import load_spec
from trainspec.jax.feed import local_rows
from trainspec.jax.train import run

from run_dirs import stop_rank_when_recorded

pytestmark = pytest.mark.slow

# A multi-host layout: the cross-process part of data parallelism is an axis of its own
# (`replica`, dcn = 2: one per process), listed first so each process holds one contiguous
# block of the batch. In one process the same spec lays both axes out in-process.
SPEC = """
seed = 0
[mesh.axes.replica]
role = "data"
size = 2
dcn = 2
[mesh.axes.data]
size = -1
[model]
d_model = 32
d_ff = 64
n_layers = 1
[batch]
seq_len = 32
global_batch = 16
micro_batch = 8
[metrics]
interval = 1
[checkpoint]
interval = 0
"""
STEPS = 8
KILL_BOUND_S = 30  # launch's grace (2 s) + the survivor's exit + polling, with load margin


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "two_hosts.toml"
    path.write_text(SPEC)
    return path


def _launch(spec_file, run_dir, *train_args, nprocs=2, grace="2", **popen):
    command = [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", str(nprocs),
               "--grace", grace, "--", sys.executable, "-m", "trainspec.cli.main", "train",
               "--host-devices", "4", "--quiet", "--spec", str(spec_file), "--run-dir",
               str(run_dir), *train_args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


def _launch_until_recorded(records, spec_file, run_dir, *train_args, **launch):
    """A job launched and running until `records` metric records are written; its output
    lines collect in the returned list (read by the returned thread)."""
    job = _launch(spec_file, run_dir, *train_args, **launch)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(job.stdout.readline, "")),
                              daemon=True)
    reader.start()
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= records):
        assert job.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
        time.sleep(0.1)
    return job, lines, reader


def _finish(job, timeout=300):
    out, _ = job.communicate(timeout=timeout)
    assert job.returncode == 0, out[-4000:]
    return out


def _losses(run_dir):
    records = read_records(run_dir)
    steps = [r["step"] for r in records]
    # One writer: each step once (two writers doubled every line), in order.
    assert steps == list(range(1, STEPS + 1)), steps
    return np.array([r["loss"] for r in records])


@pytest.fixture(scope="module")
def one_process(spec_file, tmp_path_factory):
    """The reference: the same spec in this process, on its 8 devices, xla backend."""
    run_dir = tmp_path_factory.mktemp("one_process")
    run(load_spec(spec_file), run_dir, steps=STEPS, progress=False)
    return _losses(run_dir)


# Tolerance: every run sums the same float32 per-token losses and gradients; only the order of
# the cross-device sums differs (XLA's in one process, gloo's across two, ext's rank order), a
# relative 1e-7 per step. Eight Adam steps grow that to the ~2e-7 observed (1x8 vs 2x4);
# rtol 1e-5 leaves 50x margin. A wrong data split is 300x above it: with both processes on
# block 0 (measured) the losses of steps 1-3 moved by 7e-3, 3e-3 and 3e-3 relative.
RTOL = 1e-5


def test_two_processes_follow_one_process_and_hierarchical_follows_xla(
        spec_file, one_process, tmp_path):
    xla = tmp_path / "xla"
    out = _finish(_launch(spec_file, xla, "--steps", str(STEPS), "--summary-json",
                          str(tmp_path / "summary.json")))
    np.testing.assert_allclose(_losses(xla), one_process, rtol=RTOL)
    assert one_process[-1] < one_process[0]  # it trains
    # Process 0 alone reports: one summary line, one summary file.
    assert len(re.findall(r"^\[rank (\d)\] trained \d+ steps", out, re.M)) == 1
    assert "[rank 0] trained" in out
    assert read_summary(tmp_path)["final_loss"] == _losses(xla)[-1]

    # hierarchical, checkpointed at steps 3, 6 and 8, follows xla. Then the job resumes from
    # step 3 (checkpoint 6 removed, as if lost; 8 damaged in a file process 1 wrote, which the
    # writer finds bad and both processes pass over) and redoes steps 4-8: the multi-process
    # save, the one verdict and the data position must reproduce the same curve.
    hier = tmp_path / "hierarchical"
    backend = ["--steps", str(STEPS), "--set", "collectives.backend=hierarchical",
               "--set", "checkpoint.interval=3"]
    _finish(_launch(spec_file, hier, *backend))
    np.testing.assert_allclose(_losses(hier), _losses(xla), rtol=RTOL)
    assert sorted(os.listdir(hier / "checkpoints"), key=int) == ["3", "6", "8"]
    shutil.rmtree(hier / "checkpoints" / "6")
    damaged = max((hier / "checkpoints" / "8" / "state").glob("ocdbt.process_1/d/*"),
                  key=lambda p: p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    _finish(_launch(spec_file, hier, *backend, "--summary-json", str(tmp_path / "resumed.json")))
    assert json.loads((tmp_path / "resumed.json").read_text())["resumed_from"] == 3
    assert (hier / "checkpoints-quarantine" / "8").is_dir()  # moved aside once, by the writer
    np.testing.assert_allclose(_losses(hier), _losses(xla), rtol=RTOL)


def test_two_processes_start_from_a_file_and_process_0_writes_it_back(spec_file, tmp_path):
    """--init-from across processes: each places its own shards of the file's parameters (the
    float32 NumPy reference's draws, which no JAX init makes), and the run's own
    initial_params.safetensors, gathered from both processes' devices, holds them bit for bit."""
    spec = load_spec(spec_file)
    given = tmp_path / "given.safetensors"
    params_file.write(given, leaves(initial_params(spec.model, seed=7)), spec.model)
    run_dir = tmp_path / "from_file"
    _finish(_launch(spec_file, run_dir, "--steps", "2", "--init-from", str(given)))
    written, expected = (load_file(str(p)) for p in (run_dir / params_file.FILE_NAME, given))
    assert sorted(written) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(written[name], expected[name], err_msg=name)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_killed_rank_stops_a_training_job(spec_file, tmp_path):
    """kill -9 of rank 1 mid-run (after step 2 is recorded): launch stops rank 0, which would
    otherwise wait in its next collective, and exits 137 within the bound; no rank is left."""
    run_dir = tmp_path / "killed"
    job, lines, reader = _launch_until_recorded(
        2, spec_file, run_dir, "--steps", "10000", "--set", "collectives.backend=hierarchical")
    pids = [int(m.group(1)) for line in list(lines)
            if (m := re.match(r"\[launch\] rank \d+ pid (\d+)", line))]
    assert len(pids) == 2, lines
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    code = job.wait(timeout=KILL_BOUND_S + 30)
    elapsed = time.monotonic() - t0
    reader.join(timeout=5)
    assert code == 137, "".join(lines)[-4000:]
    assert elapsed < KILL_BOUND_S, elapsed
    assert not any(_alive(pid) for pid in pids), "a rank outlived the job"
    assert any("rank 1 was killed by SIGKILL first; stopping the others" in line for line in lines)


def _assert_rank_1_blamed(out, timeout_s, step, last_entered):
    """Rank 0's one line names rank 1 (at `step`, `last_entered` its own mark: patterns), and
    launch blames rank 1; no traceback."""
    assert re.search(
        rf"\[rank 0\] trainspec: error: collectives.timeout_s: step {step}'s [\w-]+ waited up "
        rf"to {timeout_s} s for rank\(s\) 1, which did not arrive \(rank 1 last entered step "
        rf"{last_entered}; rank 0 had entered step \d+\)", out), out[-4000:]
    assert ("[launch] rank(s) 1 did not arrive (rank 0 exited with status 2 saying so); "
            "stopping the others") in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]


def test_a_process_that_does_not_arrive_fails_the_job_after_the_collective_timeout(
        spec_file, tmp_path):
    """Rank 1 stops for 90 s before step 3: rank 0's gradient all-reduce (XLA's, over gloo)
    gives up after collectives.timeout_s, says in one line that rank 1 did not arrive at step
    3, and launch blames rank 1, not rank 0 that exited first, and stops it. Without
    the spec's timeout gloo waits the stall out and the job succeeds (docs/spec.md: a
    collective MUST fail after timeout_s, not hang)."""
    # The timeout leaves room for the ranks' compile times to differ on a loaded machine (the
    # first step's all-reduce waits for the slower one); the stall is well beyond it.
    stall_s, timeout_s = 90, 20
    faults = {"delay_s": stall_s, "delay_process": 1, "delay_steps": [3]}
    job = _launch(spec_file, tmp_path / "run", "--steps", "6", "--set",
                  f"collectives.timeout_s={timeout_s}",
                  env={**os.environ, "TRAINSPEC_FAULTS": json.dumps(faults)})
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 2, out[-4000:]
    _assert_rank_1_blamed(out, timeout_s, "3", "2")


def test_a_stopped_rank_is_named_by_the_survivor_and_blamed_by_launch(spec_file, tmp_path):
    """SIGSTOP to rank 1 mid-run: rank 0's collective gives up after collectives.timeout_s and
    names rank 1 and its stopped process in one line; launch blames rank 1 (not rank 0, the
    first to exit) and kills it; exit 2 within the timeout and a margin, no traceback."""
    timeout_s = 20
    job = _launch(spec_file, tmp_path / "run", "--steps", "10000", "--set", "metrics.interval=1",
                  "--set", f"collectives.timeout_s={timeout_s}")
    code, elapsed, out, pids = stop_rank_when_recorded(job, tmp_path / "run", rank=1)
    assert code == 2, out[-4000:]
    assert elapsed < timeout_s + KILL_BOUND_S, elapsed
    _assert_rank_1_blamed(out, timeout_s, r"\d+", rf"\d+, its process {pids[1]} stopped")
    assert not any(_alive(pid) for pid in pids.values()), "a rank outlived the job"


def test_sigterm_to_launch_checkpoints_every_rank_and_resumes_bitwise(spec_file, tmp_path):
    """SIGTERM to the launcher mid-run: both ranks finish the same step, checkpoint it, and
    exit 143; the relaunch resumes there and every loss equals an uninterrupted run's."""
    steps, ckpt = "40", ["--set", "checkpoint.interval=1000"]  # only the stop's checkpoint
    reference = tmp_path / "reference"
    _finish(_launch(spec_file, reference, "--steps", steps, *ckpt))
    run_dir = tmp_path / "stopped"
    job, lines, reader = _launch_until_recorded(3, spec_file, run_dir, "--steps", steps, *ckpt,
                                                grace="60")
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 143, "".join(lines)[-4000:]
    reader.join(timeout=5)
    saved = sorted(int(p) for p in os.listdir(run_dir / "checkpoints"))
    assert len(saved) == 1 and 3 <= saved[0] < int(steps), saved
    out = "".join(lines)
    assert "[launch] rank 0 exited with status 143, rank 1 exited with status 143" in out, out
    assert f"SIGTERM after step {saved[0]}; checkpoint {saved[0]} is in" in out, out
    _finish(_launch(spec_file, run_dir, "--steps", steps, *ckpt, "--summary-json",
                    str(tmp_path / "resumed.json")))
    assert json.loads((tmp_path / "resumed.json").read_text())["resumed_from"] == saved[0]
    resumed = [(r["step"], r["loss"]) for r in read_records(run_dir)]
    assert resumed == [(r["step"], r["loss"]) for r in read_records(reference)]


# ---- checks that need no second process -----------------------------------------------------


def _fake_mesh(processes, names):
    """What check_hierarchical reads of a mesh: devices (with process_index) and axis names."""
    devices = np.vectorize(lambda p: SimpleNamespace(process_index=int(p)), otypes=[object])(
        np.asarray(processes))
    return SimpleNamespace(devices=devices, axis_names=names)


def test_hierarchical_needs_the_cross_process_part_as_its_own_axis():
    spec = load_spec(None, ["collectives.backend=hierarchical", "mesh.axes.data.dcn=2"])
    one_axis = _fake_mesh(np.repeat([0, 1], 4).reshape(8, 1, 1), ("data", "fsdp", "tensor"))
    with pytest.raises(UserInputError, match=r"mesh.axes.data: .*hierarchical.*replica"):
        check_hierarchical(spec, one_axis)
    split = load_spec(SPEC, ["collectives.backend=hierarchical"])
    check_hierarchical(split, _fake_mesh(np.repeat([0, 1], 4).reshape(2, 4), ("replica", "data")))
    check_hierarchical(load_spec(None, ["mesh.axes.data.dcn=2"]), one_axis)  # xla: no constraint


class _FakeSharding:
    def __init__(self, row_blocks):
        self.row_blocks = row_blocks

    def addressable_devices_indices_map(self, shape):
        return {i: (slice(a, b), slice(None)) for i, (a, b) in enumerate(self.row_blocks)}


def _step(row_blocks):
    spec = load_spec(None, ["batch.global_batch=16", "batch.seq_len=8"])
    return SimpleNamespace(spec=spec, batch_sharding=lambda ndim: _FakeSharding(row_blocks))


def test_local_rows_come_from_the_batch_sharding():
    assert local_rows(_step([(8, 10), (10, 12), (12, 16)])) == slice(8, 16)  # not block p
    with pytest.raises(UserInputError, match="not one contiguous block"):
        local_rows(_step([(0, 2), (4, 6)]))  # interleaved with another process's rows
