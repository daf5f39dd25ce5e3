"""The torch step in one process (a one-rank job): the learning rate follows optax's schedule,
the non-finite policy skips then halts with the last good state checkpointed, and 16-bit
compute runs. Multi-rank behaviour is in test_torch_train.py and test_torch_equality.py."""
import json
import math

import numpy as np
import pytest
import torch

from cli_runs import read_records
from trainspec.core.bad_steps import batch_index
from trainspec.core.data import ByteBatches
from trainspec.core.faults import Faults
from trainspec.core.health import HealthHalt
from trainspec.jax.train import make_optimizer
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.run import Run
from trainspec.core.reference_train import learning_rate
from trainspec.torch.train import TorchStep
from tiny import tiny_spec


@pytest.fixture(scope="module")
def adapter():
    adapter = TorchRuntime()
    adapter.join()  # no launcher in the environment: a job of one rank
    yield adapter
    adapter.leave()


@pytest.mark.parametrize("warmup,total", [(2, 20), (10, 60), (0, 5), (30, 10)])
def test_learning_rate_is_the_jax_optimizers(warmup, total):
    """make_optimizer's SGD (momentum 0.9) fed a constant gradient 1: update n is
    -lr(n) * trace(n) with trace(n) = sum of 0.9^i, so its learning rate can be read back."""
    spec = tiny_spec(f"optimizer.warmup_steps={warmup}", "optimizer.name=sgd")
    tx = make_optimizer(spec, total)
    params = {"w": np.zeros((), np.float32)}
    state = tx.init(params)
    trace = 0.0
    for count in range(total + 3):
        updates, state = tx.update({"w": np.ones((), np.float32)}, state, params)
        trace = 1.0 + 0.9 * trace
        jax_lr = -float(updates["w"]) / trace
        assert math.isclose(learning_rate(spec.optimizer, total, count), jax_lr,
                            rel_tol=1e-5, abs_tol=1e-9), count


def _poison(model, value):
    """An init_fn of `Run.resume`: the head's weights set to `value` in place."""
    model.head.weight.fill_(value)


def _own_loop(spec, run_dir, steps, adapter, poison=False, skipped=(), **options):
    """An own loop on one rank through the torch Run: (the step, the run, its losses).
    `poison`: resume with an init_fn that makes the head non-finite (on a fresh start);
    `skipped`: data indices the loop's data leaves out; `options`: the Run's."""
    job = TorchStep(spec, adapter.build_mesh(spec), steps, adapter.device)
    data, rows = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed), job.rows()
    run = Run(spec, run_dir, job, steps, progress=False, **options)
    with run:
        state = run.resume(_poison, float("nan")) if poison else run.resume()
        for batch in run.batches(lambda i: data.batch(batch_index(i, set(skipped)), rows)):
            state, metrics = run.step(state, batch)
            state = run.after_step(state, metrics)
    return job, run, run.recorder.losses


def test_nonfinite_steps_are_skipped_then_halt(tmp_path, adapter):
    spec = tiny_spec("metrics.interval=1", "checkpoint.interval=2", "health.nan.policy=skip",
                     "health.nan.max_consecutive_skips=2")
    with pytest.raises(HealthHalt, match="at step 3") as halt:
        _own_loop(spec, tmp_path, 6, adapter, poison=True)
    # steps 1-3 non-finite and dropped (no update, no optimizer state); the third is one too
    # many in a row: halted, with the state after step 2 checkpointed and named
    assert f"the state after step 2 is checkpoint 2 in {tmp_path}" in str(halt.value)
    meta = json.loads((tmp_path / "checkpoints" / "2" / "manifest.json").read_text())["meta"]
    assert (meta["updates"], meta["skipped_steps"]) == (0, 2)
    records = read_records(tmp_path)
    assert [(r["step"], r["skipped_steps"], r["loss"]) for r in records] == [
        (1, 1, None), (2, 2, None)]


def test_halt_policy_stops_at_the_first_nonfinite_step(tmp_path, adapter):
    spec = tiny_spec("metrics.interval=1", "checkpoint.interval=0", "health.nan.policy=halt")
    with pytest.raises(HealthHalt, match="step 1"):
        _own_loop(spec, tmp_path, 4, adapter, poison=True)


def test_resume_calls_init_fn_only_without_a_checkpoint(tmp_path, adapter):
    """A resume loads checkpoint 2: the poisoning init_fn is not called, every loss finite."""
    spec = tiny_spec("metrics.interval=1", "checkpoint.interval=2", "health.nan.policy=halt")
    _own_loop(spec, tmp_path, 2, adapter)
    _, run, losses = _own_loop(spec, tmp_path, 4, adapter, poison=True)
    assert run.start == 2 and all(math.isfinite(losses[step]) for step in (3, 4)), losses


ROLLBACK = ["metrics.interval=1", "checkpoint.interval=4"]


@pytest.fixture(scope="module")
def clean_without_batches_4_and_5(tmp_path_factory, adapter):
    """(the step, its losses) of the clean 10-step run that never reads batches 4 and 5: what
    both rollback runs below must equal bit for bit (one clean run for the two of them)."""
    job, _, losses = _own_loop(tiny_spec(*ROLLBACK), tmp_path_factory.mktemp("clean"), 10,
                               adapter, skipped={4, 5})
    return job, losses


# Batches named 0-based; Faults' nan_steps name them 1-based. Checkpoint 4 has read batches 0-3.
@pytest.mark.parametrize("skip_batches,nan_steps,rollbacks", [
    # NaN in batches 4 and 5: step 5 is bad twice, each rollback skips the one batch it read
    pytest.param(1, {5, 6}, [(5, 4, [4]), (5, 4, [5])], id="skip_batches=1"),
    # NaN in batch 5 only: step 6 is bad, two steps after the checkpoint, so of the three
    # batches to skip only steps 5 and 6's go; batch 3 is checkpoint 4's and stays in
    pytest.param(3, {6}, [(6, 4, [4, 5])], id="skip_batches=3"),
])
def test_rollback_policy_skips_nan_batches_and_resumes_bitwise(
        tmp_path, adapter, clean_without_batches_4_and_5, skip_batches, nan_steps, rollbacks):
    """The default policy on torch: a NaN (read on the host, no extra sync) rolls back to
    checkpoint 4 and skips the bad step's batch and the health.nan.skip_batches - 1 before it
    that came after the checkpoint; from there the run is bit for bit the clean run that never
    read them, and its checkpoints carry them."""
    spec = tiny_spec(*ROLLBACK, f"health.nan.skip_batches={skip_batches}")
    assert spec.health.nan.policy == "rollback"
    job, run, losses = _own_loop(spec, tmp_path, 10, adapter,
                                 faults=Faults(nan_steps=frozenset(nan_steps)))
    assert [(r["bad_step"], r["restored_step"], r["skipped_batches"])
            for r in run.rollbacks] == rollbacks
    clean, clean_losses = clean_without_batches_4_and_5
    assert losses == clean_losses and all(math.isfinite(v) for v in losses.values())
    for ours, theirs in zip(job.params, clean.params, strict=True):
        assert torch.equal(ours.detach(), theirs.detach())
    meta = json.loads((tmp_path / "checkpoints" / "10" / "manifest.json").read_text())["meta"]
    assert meta["skipped_batches"] == [4, 5]


def test_the_state_check_finds_a_nan_the_loss_does_not_read(tmp_path, adapter):
    """The check the run makes before each checkpoint: after a clean run the state passes; a
    NaN in the optimizer's state, or an inf in a parameter, fails it."""
    spec = tiny_spec("metrics.interval=1", "checkpoint.interval=0")
    job, run, _ = _own_loop(spec, tmp_path, 2, adapter)
    assert run.step.state_is_finite(job)
    moments = [v for per_param in job.optimizer.state.values() for v in per_param.values()
               if torch.is_tensor(v) and v.is_floating_point() and v.numel() > 1]
    with torch.no_grad():
        saved = moments[-1].view(-1)[-1].item()
        moments[-1].view(-1)[-1] = float("nan")
        assert not run.step.state_is_finite(job)
        moments[-1].view(-1)[-1] = saved
        assert run.step.state_is_finite(job)
        job.params[0].view(-1)[0] = float("inf")
        assert not run.step.state_is_finite(job)


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_sixteen_bit_compute_learns(tmp_path, adapter, compute):
    spec = tiny_spec("metrics.interval=1", "checkpoint.interval=0", f"precision.compute={compute}",
                     "optimizer.warmup_steps=1")
    job, _, losses = _own_loop(spec, tmp_path, 8, adapter)
    assert job.model.head.compute == getattr(torch, compute)
    assert losses[8] < losses[1] - 0.2, losses


def test_arrays_cross_frameworks_through_dlpack(adapter):
    """The interface's conversions: a jax array viewed by torch and back, bytes unchanged, and
    the same fingerprint from each implementation (the xla_ext custom call for JAX)."""
    import jax.numpy as jnp
    from trainspec.jax.conformance import JaxConformance
    from trainspec.core.fingerprint import fingerprint_reference

    jax_adapter = JaxConformance("xla")
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7
    as_torch = adapter.from_dlpack(jax_adapter.to_dlpack(x))
    back = jax_adapter.from_dlpack(adapter.to_dlpack(as_torch))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    want = tuple(int(w) for w in fingerprint_reference(np.asarray(x)))
    assert adapter.fingerprint(as_torch) == jax_adapter.fingerprint(x) == want
    half = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)  # no NumPy dtype: raw bytes
    raw = half.view(torch.int16).numpy()
    assert adapter.fingerprint(half) == tuple(int(w) for w in fingerprint_reference(raw))
