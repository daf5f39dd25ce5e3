"""`checkpoint.async_save = true` on torch (trainspec/torch/background_save.py):

- the state a save holds is the one of its step, though the step goes on changing the tensors
  in place while it is written (one rank, in process);
- a job on 2 gloo ranks that saves in the background trains the synchronous job's losses bit
  for bit, and resumed from its step-4 checkpoint (written while steps 5-8 trained) it goes on
  to those losses bit for bit (2 ranks: each writes its own file and the seal waits for both,
  the same code as on more ranks at half the processes);
- a save held in the middle of its write (every rank's file written, never sealed) lets
  training go on,
  and after kill -9 of the whole job it is never taken for a checkpoint: the rerun resumes from
  the one before it, bit for bit.
"""
import os
import shutil
import subprocess
import time

import pytest
import torch

import trainspec.torch
from gpt_model import GPT, GPTConfig, adamw, token_loss
from run_dirs import recorded_losses
from tiny import TINY
from cli_runs import read_summary, run_cli_ok, run_dir_of, start_cli, train_command
from trainspec.core.conformance_runner import ragged_batch
from trainspec.core.data import ByteBatches
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.torch.runtime import TorchRuntime

pytestmark = pytest.mark.slow  # five torch jobs of 2 ranks: about a minute on 2 cores

STEPS, RANKS = 12, 2
SETS = [*TINY, "metrics.interval=1", "checkpoint.interval=4", "checkpoint.keep=3"]
# Holds the save of step 8 in the middle of its write: the seal (rank 0 writes the manifest
# and renames, after every rank's file) never returns; a file says it got there.
HOLD_SAVE = '''
import time
from trainspec.core.store import Checkpoints

seal = Checkpoints.seal

def held(self, step, meta, keep):
    if step == 8:
        (self.directory.parent / "held").touch()
        time.sleep(3600)
    return seal(self, step, meta, keep)

Checkpoints.seal = held
'''


def _cmd(run_dir, asynchronous: bool):
    sets = [*SETS, f"checkpoint.async_save={str(asynchronous).lower()}"]
    return train_command(run_dir, sets, steps=STEPS, framework="torch", nprocs=RANKS)


def _run(cmd, env=None):
    run_cli_ok(cmd, env=env)
    return read_summary(run_dir_of(cmd))


def _good(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sync")
    _run(_cmd(run_dir, asynchronous=False))
    return recorded_losses(run_dir)


def test_a_background_save_holds_the_state_of_its_step(tmp_path):
    adapter = TorchRuntime()
    adapter.join()  # no launcher in the environment: a job of one rank
    try:
        spec = load_spec(DEFAULT_SPEC_PATH, ["batch.seq_len=16", "batch.global_batch=4",
                                             "checkpoint.async_save=true"])
        data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)

        def wrap():
            return trainspec.torch.wrap(lambda: GPT(GPTConfig()), token_loss, spec,
                                        optimizer_fn=adamw)

        step = wrap()
        step(ragged_batch(data, 0))
        saved = [p.detach().clone() for p in step.params]
        checkpoints = trainspec.torch.TorchCheckpointer(spec, tmp_path)
        step.save(checkpoints, 1)
        step(ragged_batch(data, 1))  # updates the parameters in place while the save is written
        assert not all(torch.equal(a, b) for a, b in zip(saved, step.params))
        checkpoints.wait()
        restored = wrap()
        assert restored.restore(trainspec.torch.TorchCheckpointer(spec, tmp_path)) == 1
        assert all(torch.equal(a, b) for a, b in zip(saved, restored.params))
    finally:
        adapter.leave()


def test_background_saves_train_and_resume_as_synchronous_ones(tmp_path, synchronous):
    summary = _run(_cmd(tmp_path, asynchronous=True))
    assert summary["last_checkpoint"] == STEPS and _good(tmp_path) == ["12", "4", "8"]
    assert recorded_losses(tmp_path) == synchronous
    for later in ("8", "12"):  # resume from step 4, saved while steps 5 to 8 trained
        shutil.rmtree(tmp_path / "checkpoints" / later)
    assert _run(_cmd(tmp_path, asynchronous=True))["resumed_from"] == 4
    assert recorded_losses(tmp_path) == synchronous


def test_kill_9_during_a_background_save_never_leaves_it_taken_as_good(tmp_path, synchronous):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_SAVE)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    proc = start_cli(_cmd(run_dir, asynchronous=True), env=env, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        # the save of step 8 is held; training goes on until the next save waits for it
        while not ((run_dir / "held").exists() and max(recorded_losses(run_dir), default=0) >= STEPS):
            assert proc.poll() is None and time.time() < deadline, "the held run ended"
            time.sleep(0.05)
        assert _good(run_dir) == ["4", "8.partial"]  # 8's shards written, never marked good
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    summary = _run(_cmd(run_dir, asynchronous=True))
    assert summary["resumed_from"] == 4 and summary["last_checkpoint"] == STEPS
    assert recorded_losses(run_dir) == synchronous
