"""`[semi_sync]` (DiLoCo): the data axes carry traffic only at outer steps, H = 1 with a plain
outer step is synchronous training, kill -9 resumes bit for bit, and bad input is one line."""
import json

import jax
import numpy as np
import pytest

from trainspec.jax.checkpoint import Checkpointer
from trainspec.cli.main import main
from trainspec.core.errors import UserInputError
from trainspec.core.spec import DEFAULT_SPEC_PATH
from trainspec.jax.metrics.comm import analyze_compiled
from trainspec.jax.semi_sync import SemiSyncStep
from trainspec.jax.train import build_job
from run_dirs import recorded_losses
from tiny import TINY, tiny_spec
from cli_runs import cli_env, kill_9_after_first_checkpoint, run_cli_ok, read_summary
from cli_runs import train_command

pytestmark = pytest.mark.slow

# The inner program moves nothing over the data axes: not even the step's metrics or the
# non-finite guard's flag, which stay per group until the host reads them (before they did,
# 45-69 bytes of scalars per step).
SCALAR_BYTES = 0


def _data_collectives(volume):
    return [c for c in volume.collectives if "data" in c.axes]


@pytest.fixture(scope="module")
def programs():
    """compression -> (job after compile, inner CommVolume, outer CommVolume, amortised)."""
    out = {}
    for compression in ("none", "int8"):
        # the skip guard: one per group, tested below
        job = build_job(tiny_spec("semi_sync.inner_steps=4", f'collectives.compression="{compression}"',
                                  "health.nan.policy=skip", layout="fsdp4"))
        batch = job.step.shard_batch(job.data.batch(0))
        compiled = job.step.compile(job.state, batch)
        out[compression] = (job, analyze_compiled(compiled, job.step.mesh),
                            analyze_compiled(job.step._outer_compiled, job.step.mesh),
                            job.step.comm_volume(compiled))
    return out


def test_data_axes_carry_the_deltas_only_at_outer_steps(programs):
    job, inner, outer, amortised = programs["none"]
    elements = sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(job.state.anchor))
    # inner: the groups work alone (their fsdp axis gathers and reduces as usual)
    assert sum(c.bytes_per_step for c in _data_collectives(inner)) <= SCALAR_BYTES
    assert sum(c.bytes_per_step for c in inner.collectives if c.axes == ("fsdp",)) > 4 * elements
    # outer: one float32 all-reduce of the delta shard, over data only
    (delta,) = outer.collectives
    assert (delta.kind, delta.axes, delta.bytes, delta.count) == ("all-reduce", ("data",), 4 * elements, 1)
    assert amortised.total_bytes == pytest.approx(inner.total_bytes + delta.bytes / 4)
    print(f"inner {inner.total_bytes:.0f} B/step ({sum(c.bytes_per_step for c in _data_collectives(inner)):.0f}"
          f" over data), outer {outer.total_bytes:.0f} B, amortised {amortised.total_bytes:.0f} B/step")


def test_tensor_parallel_groups_reduce_within_themselves():
    """data 2 x tensor 4: the inner program's activation reductions stay on `tensor`; the outer
    one all-reduces each device's (tensor-split) delta shard over `data`."""
    job = build_job(tiny_spec("semi_sync.inner_steps=2", layout="tensor"))
    inner = analyze_compiled(job.step.compile(job.state, job.step.shard_batch(job.data.batch(0))),
                             job.step.mesh)
    outer = analyze_compiled(job.step._outer_compiled, job.step.mesh)
    elements = sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(job.state.anchor))
    assert inner.by_axis().get("tensor", 0) > 0
    assert sum(c.bytes_per_step for c in _data_collectives(inner)) <= SCALAR_BYTES
    assert outer.by_kind_and_axis() == {"all-reduce": {"data": 4 * elements}}


def test_compression_applies_to_the_delta_exchange(programs):
    """int8 payload and scales in the two-stage exchange (all-to-all, then all-gather): bus
    bytes (nccl-tests) ~4x fewer than float32's."""
    none_outer = programs["none"][2].bus_bytes
    job, inner, outer, _ = programs["int8"]
    assert sum(c.bytes_per_step for c in _data_collectives(inner)) <= SCALAR_BYTES
    assert {c.kind for c in outer.collectives} == {"all-to-all", "all-gather"}
    assert 3.5 <= none_outer / outer.bus_bytes <= 4.0, (none_outer, outer.bus_bytes)
    residual = jax.tree.leaves(job.state.ef_residual)[0]
    assert residual.shape[0] == 2 and residual.sharding.spec[0] in ("data", ("data",))


def test_outer_step_makes_the_groups_agree_on_the_anchor(programs):
    """Groups diverge over the inner steps, and after the 4th (the outer step) every group's
    parameters are the new anchor."""
    job = programs["none"][0]
    state = job.step.init(job.init_fn, jax.random.key(0))  # the fixture's state stays undonated
    initial = [np.asarray(a) for a in jax.tree.leaves(state.anchor)]
    job.step.reset_guard(0)
    for i in range(4):
        state, _ = job.step(state, job.data.batch(i))
        params = [np.asarray(x) for x in jax.tree.leaves(state.inner.params)]
        spread = max(float(np.max(np.ptp(p, axis=0))) for p in params)
        if i > 0:  # (the first step's warm-up learning rate is 0)
            assert (spread == 0) == (i == 3), (i, spread)
    for p, a, a0 in zip(params, jax.tree.leaves(state.anchor), initial):
        np.testing.assert_array_equal(p[0], np.asarray(a))
        assert np.any(np.asarray(a) != a0)  # the outer step moved the anchor


def test_a_non_finite_group_drops_only_its_own_step(programs):
    """NaN in group 1's rows only: group 1 keeps its inner state bit for bit, group 0 trains
    on; the host sees the step as non-finite (any group) and counts it skipped; the record's
    loss combines both groups (NaN), its tokens are group 0's."""
    job = programs["none"][0]
    state = job.step.init(job.init_fn, jax.random.key(0))
    job.step.reset_guard(0)
    state, _ = job.step(state, job.data.batch(0))
    before = [np.asarray(x) for x in jax.tree.leaves(state.inner.params)]
    batch = job.data.batch(1)
    mask = np.array(batch["mask"], np.float32)
    mask[len(mask) // 2:] = np.nan  # the second half of the rows: group 1's
    state, metrics = job.step(state, {**batch, "mask": mask})
    after = [np.asarray(x) for x in jax.tree.leaves(state.inner.params)]
    for b, a in zip(before, after):
        assert np.any(b[0] != a[0])  # group 0 took its step
        np.testing.assert_array_equal(b[1], a[1])  # group 1 kept its state
    combined = job.step.host_metrics(metrics)
    assert combined["nonfinite"] == 1 and combined["skipped_steps"] == 1
    assert np.isnan(combined["loss"])
    assert combined["valid_tokens"] == np.sum(np.asarray(batch["mask"])[: len(mask) // 2])
    assert job.step.check_nonfinite() == 1 and job.step.nonfinite_counts() == {
        "skipped_steps": 1, "consecutive_nonfinite": 1}


# -- H = 1, outer_lr = 1, momentum 0 is synchronous training -------------------------------------
# With SGD (linear in the gradient, no clipping) and equal valid tokens per group, one inner step
# from the anchor and the mean delta give anchor - lr * mean(group gradients' updates): the
# synchronous update, in another summation order. The two differ by float32 rounding of the
# averages: a few ulps of the values per step (ulp(max|param|) = 2^-23 max|param|), so 32 ulps of
# max|param| bounds 6 steps; a perturbed outer step (lr 0.7, or momentum 0.1) differs by ~0.1.
SGD = ['optimizer.name="sgd"', "optimizer.grad_clip_norm=1e9", "optimizer.learning_rate=0.3"]


def _train(*overrides, steps=6):
    job = build_job(tiny_spec(*SGD, *overrides, layout="fsdp4"))
    state, losses = job.state, []
    for i in range(steps):
        state, metrics = job.step(state, job.data.batch(i))
        losses.append(float(job.step.host_metrics(metrics)["loss"]))
    return np.array(losses), [np.asarray(x, np.float64) for x in jax.tree.leaves(state.params)]


def test_one_inner_step_with_a_plain_outer_step_is_synchronous():
    sync_losses, sync_params = _train()
    scale = max(float(np.max(np.abs(p))) for p in sync_params)
    tol = 32 * 2.0**-23 * scale

    def gap(*outer):
        losses, params = _train("semi_sync.inner_steps=1", *outer)
        return (float(np.max(np.abs(losses - sync_losses))),
                max(float(np.max(np.abs(a - b))) for a, b in zip(params, sync_params)))

    loss_gap, param_gap = gap("semi_sync.outer_lr=1.0", "semi_sync.outer_momentum=0.0")
    assert param_gap <= tol and loss_gap <= 32 * 2.0**-23 * float(np.max(sync_losses)), (param_gap, loss_gap)
    # the comparison can fail: momentum in the outer step makes it another optimizer
    assert gap("semi_sync.outer_lr=1.0", "semi_sync.outer_momentum=0.1")[1] > 100 * tol


# -- resume --------------------------------------------------------------------------------------
STEPS, INTERVAL, H = 16, 4, 3  # checkpoints fall mid-round: the round continues after a resume
JOB = [*TINY, "metrics.interval=1", f"checkpoint.interval={INTERVAL}", "checkpoint.keep=2",
       f"semi_sync.inner_steps={H}"]


def _run(run_dir):
    run_cli_ok(train_command(run_dir, JOB, steps=STEPS), env=cli_env())
    return read_summary(run_dir)


def test_kill_9_then_resume_is_bitwise(tmp_path_factory):
    reference_dir, run_dir = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("killed")
    summary = _run(reference_dir)
    # the summary and records report bytes per step amortised over the round
    semi = summary["semi_sync"]
    assert semi["inner_steps"] == H and semi["groups"] == 8
    amortised = semi["inner_comm_bytes_per_step"] + semi["outer_comm_bytes"] / H
    assert summary["comm_bytes_per_step"] == pytest.approx(amortised)
    record = json.loads((reference_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["comm_bytes_per_step"] == pytest.approx(amortised)

    # killed right after the first save, not after a random delay: 16 steps take well under a
    # second, and the run must still be going when it is killed
    complete = kill_9_after_first_checkpoint(train_command(run_dir, JOB, steps=STEPS),
                                             env=cli_env())
    resumed = _run(run_dir)
    assert resumed["resumed_from"] == complete[-1] and complete[-1] < STEPS
    assert recorded_losses(run_dir) == recorded_losses(reference_dir)


def test_resume_on_another_number_of_groups_is_one_line(programs, tmp_path):
    job = programs["none"][0]
    ckpt = Checkpointer(job.spec, tmp_path)
    ckpt.save(1, job.state, total_steps=2)
    ckpt.wait()
    other = build_job(tiny_spec("semi_sync.inner_steps=4", layout="fsdp2"), init=False)
    with pytest.raises(UserInputError, match=r"^mesh\.axes: checkpoint 1 holds .* for 2 data-parallel "
                                             r"replicas, this mesh has 4;"):
        Checkpointer(other.spec, tmp_path).restore_latest(other.abstract_state)


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("settings,field", [
    (["semi_sync.inner_steps=0"], "semi_sync.inner_steps"),
    (["semi_sync.inner_steps=2", "semi_sync.outer_lr=-0.5"], "semi_sync.outer_lr"),
    (["semi_sync.inner_steps=2", "semi_sync.outer_momentum=1.0"], "semi_sync.outer_momentum"),
    (["semi_sync.inner_steps=2", 'semi_sync.outer_optimizer="adam"'], "semi_sync.outer_optimizer"),
    (["semi_sync.outer_lr=0.5"], "semi_sync.inner_steps"),  # H has no default
    (["semi_sync.inner_steps=2", "mesh.axes.data.size=1", "mesh.axes.fsdp.size=8"], "semi_sync"),
    (["semi_sync.inner_steps=2", 'layout.optimizer_state="shard_over_data"'],
     "layout.optimizer_state"),
])
def test_bad_input_is_one_line_naming_the_field(settings, field, capsys):
    sets = [a for s in settings for a in ("--set", s)]
    assert main(["validate", str(DEFAULT_SPEC_PATH), *sets]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and field in err and "Traceback" not in err, err


def test_wrap_runs_semi_sync_and_the_plain_step_refuses_it():
    import trainspec.jax
    from trainspec.jax.step import WrappedStep
    from trainspec.jax.step_forms import loss_step

    spec = tiny_spec("semi_sync.inner_steps=2", layout="fsdp4")
    step = loss_step(lambda params, batch: (0.0, 1.0, {}))
    assert isinstance(trainspec.jax.wrap(step, spec), SemiSyncStep)
    with pytest.raises(UserInputError, match="^semi_sync: this step runs synchronously"):
        WrappedStep(step, spec)
