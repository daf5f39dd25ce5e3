"""health.nan.policy = rollback (the default): a NaN step and a loss spike roll the run back to
the newest good checkpoint and skip their batches; the run then goes on bit for bit as a clean
run that never read those batches. The step itself gains no collective and no copy."""
import json
import re
import shutil

import jax
import jsonschema
import numpy as np
import pytest

from trainspec.cli.summary import print_summary
from trainspec.core.bad_steps import (VERDICT_BATCH, VERDICT_LAG, PendingVerdicts,
                                       RollbackLimit, batch_index)
from trainspec.core.faults import Faults
from trainspec.core.loop import train
from trainspec.core.records import json_schema
from trainspec.core.run import Run
from trainspec.jax.checkpoint import BadCheckpoint, Checkpointer
from trainspec.jax.train import build_job, reference_job, run

from tiny import tiny_spec

pytestmark = pytest.mark.slow

# Spikes judged over the last 10 steps: the tiny model's loss still falls fast, and a longer
# window would take that trend for noise. Its planted spike (every target byte 255) is then
# ~1.5 above the default threshold (median + 6 MAD).
SPEC = ["metrics.interval=1", "checkpoint.interval=8", "checkpoint.async_save=false",
        "health.spikes.min_steps=8", "health.spikes.window=10"]
STEPS = 32
NAN_STEP, SPIKE_STEP = 12, 28  # 1-based steps whose batches (11, 27) are bad
# health.nan.skip_batches above 1: each rollback leaves out the bad step's batch and the two
# before it that came after the restored checkpoint
SKIP_3 = [*SPEC, "health.nan.skip_batches=3"]


def _records(run_dir):
    """The last record of each step (a rollback redoes the records after its checkpoint)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _final_params(spec, run_dir):
    state, _ = Checkpointer(spec, run_dir).restore_latest(
        build_job(spec, init=False).abstract_state)
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def _clean_run(spec, run_dir, skipped, steps=STEPS):
    """The same job from step 0 without faults, its data leaving out `skipped`."""
    def build(loop):
        step, target, init, data = reference_job(spec, loop.total_steps, run_dir)
        return step, target, init, lambda i: data(batch_index(i, skipped))

    loop = Run(spec, run_dir, Checkpointer(spec, run_dir), steps, progress=False)
    return train(loop, build)


def _bad_steps(summary):
    """(bad step, restored step, skipped batches) of each rollback in a run's summary."""
    return [(r["bad_step"], r["restored_step"], r["skipped_batches"]) for r in summary["rollbacks"]]


def _assert_bitwise_the_clean_run(spec, run_dir, summary, clean_dir):
    """The run in `run_dir` (its `summary`) is bit for bit, in every step's loss and in its
    final parameters, the clean run from step 0 whose data leaves out the batches it skipped."""
    clean = _clean_run(spec, clean_dir, set(summary["skipped_batches"]))
    assert clean["rollbacks"] == []
    ours, theirs = _records(run_dir), _records(clean_dir)
    assert [ours[s]["loss"] for s in ours] == [theirs[s]["loss"] for s in ours]
    for a, b in zip(_final_params(spec, run_dir), _final_params(spec, clean_dir), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    spec = tiny_spec(*SPEC)
    run_dir = tmp_path_factory.mktemp("rollback")
    faults = Faults(nan_steps=frozenset({NAN_STEP}), spike_steps=frozenset({SPIKE_STEP}))
    return spec, run_dir, run(spec, run_dir, steps=STEPS, progress=False, faults=faults)


def test_nan_and_spike_roll_back_and_skip_their_batches(rolled_back, capsys):
    _, run_dir, summary = rolled_back
    # The NaN of step 12 is judged at its own record (metrics.interval = 1): back to
    # checkpoint 8, batch 11 skipped. With batch 11 gone, step 27 reads batch 27, whose loss
    # spikes (judged at its record): back to checkpoint 24, batch 27 skipped.
    got = [(r["bad_step"], r["restored_step"], r["skipped_batches"], r["reason"].split(" at ")[0])
           for r in summary["rollbacks"]]
    assert got == [(12, 8, [11], "non-finite loss or gradients"),
                   (27, 24, [27], "loss spike")], summary["rollbacks"]
    assert summary["skipped_batches"] == [11, 27]
    records = _records(run_dir)
    assert sorted(records) == list(range(1, STEPS + 1))
    assert records[9]["rolled_back_from_step"] == 12 and records[9]["resumed_from_step"] == 8
    assert records[25]["rolled_back_from_step"] == 27
    assert [records[s]["skipped_batches"] for s in (8, 9, 24, 25, STEPS)] == [0, 1, 1, 2, 2]
    assert all(np.isfinite(r["loss"]) for r in records.values())
    for record in records.values():
        jsonschema.validate(record, json_schema())
    print_summary(summary)  # what `trainspec train` prints
    printed = capsys.readouterr().out
    assert "rolled back    to step 8: non-finite loss or gradients at step 12" in printed
    assert "skipped        batches 11, 27 (health.nan.policy = rollback)" in printed


def test_after_the_rollbacks_the_run_is_bitwise_a_clean_run_without_those_batches(
        rolled_back, tmp_path):
    spec, run_dir, summary = rolled_back
    _assert_bitwise_the_clean_run(spec, run_dir, summary, tmp_path)


def test_skip_batches_leaves_out_the_bad_batch_and_those_before_it_after_the_checkpoint(
        tmp_path):
    """health.nan.skip_batches = 3. The NaN in batch 13 (step 14, six steps after checkpoint
    8): back to 8, batches 11, 12 and 13 (steps 12-14's) left out. From then on step s > 11
    reads batch s + 2, so checkpoint 16 has trained on batch 18, and step 18 reads batch 20,
    the second NaN: back to 16, batches 19 and 20 (steps 17-18's) left out but not 18, the
    restored state's own (the bad step is two steps after the checkpoint, closer than three).
    The run is then bit for bit the clean run that never read those five batches."""
    spec = tiny_spec(*SKIP_3)
    run_dir = tmp_path / "rolled_back"
    # Faults name a batch by its 1-based index: batches 13 and 20
    summary = run(spec, run_dir, steps=STEPS, progress=False,
                  faults=Faults(nan_steps=frozenset({14, 21})))
    assert _bad_steps(summary) == [(14, 8, [11, 12, 13]), (18, 16, [19, 20])], summary["rollbacks"]
    assert summary["skipped_batches"] == [11, 12, 13, 19, 20]
    records = _records(run_dir)
    assert sorted(records) == list(range(1, STEPS + 1))
    assert [records[s]["skipped_batches"] for s in (8, 9, 16, 17, STEPS)] == [0, 3, 3, 5, 5]
    _assert_bitwise_the_clean_run(spec, run_dir, summary, tmp_path / "clean")


def test_skip_batches_count_from_the_checkpoint_restored_when_the_newest_proves_bad(
        tmp_path, monkeypatch):
    """skip_batches = 3 and a NaN in batch 17 (step 18, two steps after checkpoint 16), but
    checkpoint 16 does not read back when the rollback restores it (damaged since its save):
    the run goes back to checkpoint 8 instead. Step 16's batch 15 is then after the restored
    checkpoint too, so it is left out with 16 and 17: the window is clamped at the checkpoint
    restored, not at the newest one saved."""
    real, failed = Checkpointer.restore, []

    def restore(self, step, target):  # checkpoint 16's first read fails its checks
        if step == 16 and not failed:
            failed.append(step)
            raise BadCheckpoint("its state does not read back (damaged by the test)")
        return real(self, step, target)

    monkeypatch.setattr(Checkpointer, "restore", restore)
    summary = run(tiny_spec(*SKIP_3), tmp_path, steps=STEPS, progress=False,
                  faults=Faults(nan_steps=frozenset({18})))
    assert failed == [16]
    assert _bad_steps(summary) == [(18, 8, [15, 16, 17])], summary["rollbacks"]
    assert summary["skipped_batches"] == [15, 16, 17]


def test_a_resume_leaves_the_skipped_batches_out_too(rolled_back, tmp_path):
    """The skipped batches travel in the checkpoint: resumed to step 36, the run is still the
    clean run without batches 11 and 27."""
    spec, run_dir, _ = rolled_back
    shutil.copytree(run_dir, tmp_path / "resumed")
    resumed = run(spec, tmp_path / "resumed", steps=STEPS + 4, progress=False)
    assert resumed["resumed_from"] == STEPS and resumed["skipped_batches"] == [11, 27]
    for steps in (STEPS, STEPS + 4):  # resumed too: the schedule is planned for STEPS steps
        _clean_run(spec, tmp_path / "clean", {11, 27}, steps=steps)
    ours, theirs = _records(tmp_path / "resumed"), _records(tmp_path / "clean")
    assert [ours[s]["loss"] for s in range(1, STEPS + 5)] == [
        theirs[s]["loss"] for s in range(1, STEPS + 5)]


def test_verdicts_wait_for_a_batch_behind_the_newest_steps_or_for_a_sync():
    """The host reads no verdict of the newest VERDICT_LAG steps, and the older ones
    VERDICT_BATCH at a time; at a record, checkpoint or last step (`now`), every one."""
    pending, judged = PendingVerdicts(), []
    first_due = VERDICT_LAG + VERDICT_BATCH
    for step in range(1, first_due + VERDICT_BATCH + 1):
        pending.add(step, f"inputs of {step}")
        judged.append([s for s, _ in pending.due(now=False)])
    assert judged[first_due - 1] == list(range(1, VERDICT_BATCH + 1))
    assert judged[-1] == list(range(VERDICT_BATCH + 1, 2 * VERDICT_BATCH + 1))
    assert sum(map(bool, judged)) == 2
    pending.add(99, "inputs of 99")
    due = pending.due(now=True)
    assert [s for s, _ in due] == [*range(2 * VERDICT_BATCH + 1, first_due + VERDICT_BATCH + 1), 99]
    assert due[-1][1] == "inputs of 99" and pending.due(now=True) == []


def test_a_bad_step_between_syncs_is_judged_with_its_batch(tmp_path):
    """Records far apart (metrics.interval = 100): a NaN at step 18, after checkpoint 16, is
    read with the batch of verdicts due VERDICT_LAG + VERDICT_BATCH steps after that
    checkpoint judged every step, and rolled back from as at its own record."""
    spec = tiny_spec(*SPEC, "metrics.interval=100", "checkpoint.interval=16")
    summary = run(spec, tmp_path, steps=STEPS, progress=False,
                  faults=Faults(nan_steps=frozenset({18})))
    assert _bad_steps(summary) == [(18, 16, [17])]
    assert summary["rollbacks"][0]["step"] == 16 + VERDICT_LAG + VERDICT_BATCH


def test_a_lasting_rise_halts_after_max_rollbacks(tmp_path):
    """Every batch from step 25 on spikes: each rollback meets the next one; after
    max_rollbacks = 2 the run halts, naming the last good checkpoint."""
    spec = tiny_spec(*SPEC, "health.nan.max_rollbacks=2")
    faults = Faults(spike_steps=frozenset(range(25, 2 * STEPS)))
    with pytest.raises(RollbackLimit, match=r"loss spike at step 25: .* after 2 rollbacks "
                       r"\(health.nan.max_rollbacks = 2\); the last good state is checkpoint 24"):
        run(spec, tmp_path, steps=STEPS, progress=False, faults=faults)
    assert max(Checkpointer(spec, tmp_path).steps()) == 24


def test_without_a_checkpoint_to_roll_back_to_the_run_halts_in_one_line(tmp_path):
    spec = tiny_spec(*SPEC)
    with pytest.raises(RollbackLimit, match=r"^non-finite loss or gradients at step 2, "
                       r"and no checkpoint to roll back to \(") as err:
        run(spec, tmp_path, steps=STEPS, progress=False, faults=Faults(nan_steps=frozenset({2})))
    assert "\n" not in str(err.value)


def test_a_nonfinite_state_no_loss_shows_is_found_before_a_checkpoint_and_its_step_skipped(
        tmp_path):
    """An own loop whose step writes a NaN into a leaf its loss never reads, at step 14 (batch
    13): every loss and gradient norm stays finite. The check before checkpoint 16 finds the
    state non-finite; the run goes back to checkpoint 8 and replays, checking every state,
    which names step 14; back to 8 again without batch 13. The run is then bit for bit the
    clean run that never read batch 13."""
    import jax.numpy as jnp

    import trainspec.jax

    spec = tiny_spec("metrics.interval=1", "checkpoint.interval=8", "checkpoint.async_save=false")
    rows, poisoned = spec.batch.global_batch, 13

    def batch_at(i):
        x = np.random.default_rng(i).normal(size=(rows, 4)).astype(np.float32)
        return {"x": x, "y": x.sum(1), "poison": np.full(rows, np.nan if i == poisoned else 0.0,
                                                         np.float32)}

    def step(state, batch):
        loss, grad = jax.value_and_grad(
            lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
        return ({"w": state["w"] - 0.05 * grad, "unused": state["unused"] + batch["poison"][0]},
                {"loss": loss, "grad_norm": jnp.linalg.norm(grad)})

    def own_loop(run_dir, data):
        wrapped = trainspec.jax.wrap(step, spec)
        with trainspec.jax.Run(spec, run_dir, wrapped, 20, progress=False) as loop:
            state = loop.resume(lambda: {"w": jnp.zeros(4), "unused": jnp.zeros(3)})
            for batch in loop.batches(data):
                state, metrics = wrapped(state, batch)
                state = loop.after_step(state, metrics)
        return loop.summary(), jax.tree.map(np.asarray, state)

    summary, state = own_loop(tmp_path / "poisoned", batch_at)
    got = [(r["bad_step"], r["restored_step"], r["skipped_batches"], r.get("searched_to_step"))
           for r in summary["rollbacks"]]
    assert got == [(None, 8, [], 16), (14, 8, [13], None)], summary["rollbacks"]
    assert summary["rollbacks"][1]["reason"] == "non-finite state after step 14"
    assert summary["skipped_batches"] == [13]
    clean_summary, clean = own_loop(tmp_path / "clean", lambda i: batch_at(batch_index(i, {13})))
    assert clean_summary["rollbacks"] == []
    assert np.isfinite(state["unused"]).all()
    for ours, theirs in zip(jax.tree.leaves(state), jax.tree.leaves(clean), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    ours, theirs = _records(tmp_path / "poisoned"), _records(tmp_path / "clean")
    assert sorted(ours) == list(range(1, 21))
    assert [ours[s]["loss"] for s in ours] == [theirs[s]["loss"] for s in ours]


def _compiled_ops(spec, nan_guard=True):
    """(all-reduces, conditionals, copies, selects of arrays) of the compiled step, its
    temporary bytes and the state's bytes. Scalar selects are left out: they clamp the start
    of each device's slice."""
    job = build_job(spec)
    job.step.nan_guard = nan_guard  # before the step is built
    job.step.rolls_back &= nan_guard
    compiled = job.step.lower(job.state, job.data.batch(0)).compile()
    hlo = compiled.as_text()
    count = lambda op: len(re.findall(rf"\) {op}\(|\}} {op}\(|\] {op}\(", hlo))  # noqa: E731
    array_selects = len(re.findall(r"\[\d[^\]]*\]\S* select\(", hlo))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(job.state))
    return ((count("all-reduce"), count("conditional"), count("copy"), array_selects),
            compiled.memory_analysis().temp_size_in_bytes, state_bytes)


@pytest.mark.parametrize("layout", ["data", "fsdp2"])
def test_the_default_guard_adds_no_all_reduce_and_no_copy(layout):
    """Compiled on 8 devices, the default step has the unguarded step's all-reduces, copies
    and array selects, no conditional, and no more temporary memory than its flags (a kept
    copy of the state would be the state's size); the skip guard adds an all-reduce and a
    conditional."""
    spec = tiny_spec(layout=layout)
    assert spec.health.nan.policy == "rollback"
    (default, temp, state_bytes), (unguarded, plain_temp, _) = (
        _compiled_ops(spec), _compiled_ops(spec, nan_guard=False))
    assert default == unguarded, (default, unguarded)
    assert temp - plain_temp <= 1024 < state_bytes / 100, (temp, plain_temp, state_bytes)
    skip, _, _ = _compiled_ops(tiny_spec("health.nan.policy=skip", layout=layout))
    assert skip[0] > unguarded[0] and skip[1] > 0, (skip, unguarded)


@pytest.mark.parametrize("layout", ["data", "fsdp2", "tensor"])
def test_every_element_of_the_state_is_checked_by_some_device(layout):
    """A finite loss and gradient norm, one non-finite element of the new parameters (first,
    inside or last of a leaf split by the layout): the step's own verdict cannot see it, the
    state check (run before each checkpoint) finds it; the clean state passes."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    import trainspec.jax

    spec = tiny_spec(layout=layout)
    model = nn.Dense(24, kernel_init=nn.with_logical_partitioning(
        nn.initializers.normal(), ("embed", "mlp")))

    optimizer = optax.sgd(1e-2)

    def init(key):
        params = model.init(key, jnp.zeros((1, 16)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optimizer)

    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(state.apply_fn(
            {"params": p}, batch["x"]) ** 2))(state.params)
        new = state.apply_gradients(grads=grads)
        kernel = new.params["kernel"]
        poisoned = kernel.ravel().at[batch["at"][0]].add(batch["bad"][0]).reshape(kernel.shape)
        return (new.replace(params={**new.params, "kernel": poisoned}),
                {"loss": loss, "grad_norm": optax.tree.norm(grads)})

    wrapped = trainspec.jax.wrap(step, spec)
    state = wrapped.init(init, jax.random.key(0))
    rows = spec.batch.global_batch
    x = np.random.default_rng(0).normal(size=(rows, 16)).astype(np.float32)
    for at, bad, finite in ((0, 0.0, True), (0, np.nan, False), (200, np.inf, False),
                            (16 * 24 - 1, -np.inf, False), (16 * 24 - 1, 3e38, True)):
        batch = {"x": x, "at": np.full(rows, at, np.int32), "bad": np.full(rows, bad, np.float32)}
        new, metrics = wrapped(state, batch)  # donated: the state is the same before each
        state = wrapped.init(init, jax.random.key(0))
        assert wrapped.read_verdicts([wrapped.verdict_inputs(metrics)])[0][0], (at, bad)
        assert wrapped.state_is_finite(new) == finite, (at, bad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("sliced", [False, True])
def test_the_check_finds_inf_and_nan_anywhere_and_passes_the_largest_finite_values(dtype, sliced):
    """Both reductions of the flags (max|x| over a whole block, all(isfinite) over a slice):
    +inf, -inf or NaN at the first, a middle or the last element is found; a vector holding
    the dtype's largest finite values of both signs is not flagged (a norm would overflow)."""
    import jax.numpy as jnp

    from trainspec.jax.health.nan import _has_nonfinite

    big = float(jnp.finfo(dtype).max)
    clean = jnp.asarray(np.linspace(-1, 1, 101), dtype).at[3].set(big).at[4].set(-big)
    assert not bool(_has_nonfinite(clean, sliced))
    for bad in (np.inf, -np.inf, np.nan):
        for at in (0, 50, 100):
            assert bool(_has_nonfinite(clean.at[at].set(bad), sliced)), (bad, at)
