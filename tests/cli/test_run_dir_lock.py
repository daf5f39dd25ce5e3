"""One job at a time in a run dir (trainspec/core/run_lock.py), on both frameworks: a second
`trainspec train` is refused in one line naming the holder, a killed holder's lock is taken
over, and a job's own processes never refuse each other."""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from trainspec.cli.main import main
from trainspec.core import run_lock

HOLDER = ("import sys, time; from trainspec.core import run_lock; "
          "run_lock.hold(sys.argv[1], True); print('held', flush=True); time.sleep(600)")


@pytest.fixture
def held(tmp_path):
    """A run dir locked by another process (a running job), killed -9 at the end."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    yield run_dir, holder
    holder.kill()
    holder.wait()


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_second_run_on_a_locked_run_dir_is_one_line_naming_the_holder(
        held, framework, capsys):
    run_dir, holder = held
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["train", "--framework", framework, "--run-dir", str(run_dir), "--steps", "2",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == (f"trainspec: error: --run-dir {run_dir} is in use by another run (pid "
                   f"{holder.pid} on {socket.gethostname()} since "
                   f"{json.loads((run_dir / 'run.lock').read_text())['since']}); wait for it "
                   "to end or choose another --run-dir\n")
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing written


def test_a_lock_left_by_a_killed_run_is_taken_over(held):
    run_dir, holder = held
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == holder.pid  # left behind
    run_lock.hold(run_dir, True)
    try:
        assert json.loads((run_dir / "run.lock").read_text())["pid"] == os.getpid()
    finally:
        run_lock.release_all()


def test_the_lock_is_held_while_the_job_trains_and_released_after(tmp_path, monkeypatch):
    """Through the CLI: the JAX job's training runs under the lock; a command run in-process
    leaves nothing locked behind it."""
    import trainspec.jax.train

    seen = {}

    def train(spec, run_dir, **_):
        stranger = {k: v for k, v in os.environ.items() if k != run_lock.HELD_BY_PARENT}
        probe = subprocess.run([sys.executable, "-c", HOLDER.replace("time.sleep(600)", ""),
                                str(run_dir)], capture_output=True, text=True, env=stranger)
        seen["refused"] = probe.returncode != 0 and "in use by another run" in probe.stderr
        raise trainspec.core.run_files.AlreadyTrained(run_dir, 1, 1)

    import trainspec.core.run_files
    monkeypatch.setattr(trainspec.jax.train, "run", train)
    assert main(["train", "--run-dir", str(tmp_path), "--quiet"]) == 0
    assert seen == {"refused": True}
    assert os.environ.get(run_lock.HELD_BY_PARENT) is None
    run_lock.hold(tmp_path, True)  # free again
    run_lock.release_all()


def test_a_jobs_other_processes_and_its_launched_ranks_do_not_lock(tmp_path, monkeypatch):
    """Process 1 of a job takes no lock (only the first process does); ranks started by a
    process that holds it inherit that in their environment and skip it."""
    run_lock.hold(tmp_path, False)
    assert not run_lock._held
    run_lock.hold(tmp_path, True)
    try:
        from trainspec.core.launch import Launch

        env = Launch(["true"], 2)._env(0)
        assert env[run_lock.HELD_BY_PARENT] == str(tmp_path.resolve() / "run.lock")
        child = subprocess.run([sys.executable, "-c", HOLDER.replace("time.sleep(600)", ""),
                                str(tmp_path)], env=env, capture_output=True, text=True)
        assert child.returncode == 0, child.stderr
    finally:
        run_lock.release_all()


def test_a_two_process_jax_job_on_a_locked_run_dir_is_refused_by_its_first_process(held):
    """Under `trainspec launch`, the job's process 0 takes the lock: refused in one line
    naming the holder, exit 2; the launcher stops process 1."""
    run_dir, holder = held
    stranger = {k: v for k, v in os.environ.items() if k != run_lock.HELD_BY_PARENT}
    stranger["XLA_FLAGS"] = " ".join(f for f in stranger.get("XLA_FLAGS", "").split()
                                     if "device_count" not in f)
    result = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", "2", "--grace", "2",
         "--", sys.executable, "-m", "trainspec.cli.main", "train", "--host-devices", "2",
         "--quiet", "--steps", "2", "--run-dir", str(run_dir)],
        capture_output=True, text=True, env=stranger, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert (f"[rank 0] trainspec: error: --run-dir {run_dir} is in use by another run (pid "
            f"{holder.pid} on {socket.gethostname()}") in out, out
    assert "Traceback" not in out, out
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"]  # nothing written


def test_a_refused_start_leaves_no_run_dir_it_created(tmp_path, capsys):
    """A spec that the mesh refuses (3 does not divide 8 devices) is found after the run dir,
    its lock and its checkpoint directory were made: the refusal removes the run dir this
    command created, and leaves one that was there before as it was."""
    refused = ["train", "--quiet", "--steps", "1", "--set", "mesh.axes.fsdp.size=3"]
    new = tmp_path / "runs" / "new"  # runs/ made by the command too
    assert main([*refused, "--run-dir", str(new)]) == 2
    assert capsys.readouterr().err.startswith("trainspec: error: mesh.axes: cannot infer")
    assert not (tmp_path / "runs").exists()
    kept = tmp_path / "kept"
    (kept / "notes").mkdir(parents=True)
    assert main([*refused, "--run-dir", str(kept)]) == 2
    assert (kept / "notes").is_dir()


def test_a_start_its_ranks_refuse_leaves_no_run_dir_it_created(tmp_path, monkeypatch, capfd):
    """`--nprocs` starts ranks after taking the lock; when they refuse (exit 2, each saying
    why), the run dir the command created goes too, and their line is the one line said."""
    import trainspec.cli.train
    from trainspec.core.launch import run as launch

    refusing = [sys.executable, "-c", "import sys; print('trainspec: error: model.d_model: "
                "refused by the rank', file=sys.stderr); sys.exit(2)"]
    monkeypatch.setattr(trainspec.cli.train, "launch", lambda _, ranks: launch(refusing, ranks))
    run_dir = tmp_path / "runs" / "new"
    assert main(["train", "--framework", "torch", "--nprocs", "2", "--quiet", "--run-dir",
                 str(run_dir)]) == 2
    assert not (tmp_path / "runs").exists()
    out, err = capfd.readouterr()
    said = [line for line in (out + err).splitlines()  # what the command and its ranks said
            if line.startswith(("trainspec", "[")) and not line.startswith("[launch] rank")]
    assert said == ["[rank 0] trainspec: error: model.d_model: refused by the rank"] or \
        said == ["[rank 1] trainspec: error: model.d_model: refused by the rank"], out + err
