"""`[profile]` on JAX: one traced step writes jax.profiler's trace into RUN_DIR/profile (the
xplane TensorBoard's profile plugin reads, the Perfetto trace), nothing is traced without it,
and a process the job does not have is one line."""
import gzip
import json

from tiny import TINY
from trainspec.cli.main import main


def _train(run_dir, *sets):
    argv = [a for s in (*TINY, "checkpoint.interval=0", *sets) for a in ("--set", s)]
    return main(["train", "--quiet", "--steps", "3", "--run-dir", str(run_dir), *argv])


def test_a_profiled_step_writes_a_trace_tensorboard_and_perfetto_open(tmp_path):
    assert _train(tmp_path / "run", "profile.start_step=2", "profile.steps=1") == 0
    profile = tmp_path / "run" / "profile"
    (xplane,) = profile.glob("plugins/profile/*/*.xplane.pb")
    assert xplane.stat().st_size > 1000
    (perfetto,) = profile.glob("plugins/profile/*/*.trace.json.gz")
    events = json.loads(gzip.decompress(perfetto.read_bytes()))
    assert any("jit" in str(e.get("name", "")) for e in events.get("traceEvents", events))


def test_no_trace_without_a_start_step_and_a_missing_process_is_one_line(tmp_path, capsys):
    assert _train(tmp_path / "plain") == 0
    assert not (tmp_path / "plain" / "profile").exists()
    capsys.readouterr()
    assert _train(tmp_path / "bad", "profile.start_step=1", "profile.process=2") == 2
    err = capsys.readouterr().err
    assert err == "trainspec: error: profile.process: 2, but the job has 1 processes\n", err
