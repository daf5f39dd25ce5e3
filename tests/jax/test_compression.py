"""collectives.compression: quantizers against the float64 reference (trainspec.core.compression),
the error-feedback identity, the gradient bytes of the compiled step, and bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from trainspec.jax.checkpoint import Checkpointer
from trainspec.cli.main import main
from trainspec.jax.collectives import compression as jc
from trainspec.core import compression as ref
from trainspec.core.errors import UserInputError
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.jax.mesh import build_mesh
from trainspec.jax.metrics.comm import analyze_compiled
from trainspec.jax.train import build_job
from tiny import tiny_spec

pytestmark = pytest.mark.slow

CASES = [(size, block, scale) for size, block in [(1000, 4), (1000, 32), (777, 256)]
         for scale in (1e-6, 1.0, 3e4)]


def _gradient_like(size, scale, seed=0):
    """Heavy-tailed values over several decades, like a gradient's."""
    rng = np.random.default_rng(seed)
    return (rng.standard_t(3, size) * scale * 10.0 ** rng.uniform(-3, 0, size)).astype(np.float32)


@pytest.mark.parametrize("size,block,scale", CASES)
def test_round_trip_within_the_stated_bound(size, block, scale):
    x = _gradient_like(size, scale)
    for compression in ("bf16", "int8"):
        got = np.asarray(jc.round_trip(jnp.asarray(x), compression, block), np.float64)
        want = ref.round_trip(x, compression, block)
        bound = ref.error_bound(x, compression, block)
        assert np.all(np.abs(got - x) <= bound), compression
        assert np.all(np.abs(want - x) <= bound), compression
        if compression == "bf16":  # one rounding rule, two implementations: bit for bit
            np.testing.assert_array_equal(got, want)
        else:  # float32 vs float64 division may split a tie differently: one step at most
            steps = np.repeat(ref.quantize_int8(x, block)[1], block)[:size].astype(np.float64)
            assert np.all(np.abs(got - want) <= steps * 1.0001)


def test_the_bound_is_tight_enough_to_fail():
    """A coarser quantizer (6 bits) breaks the int8 bound: the check can fail."""
    x = _gradient_like(1000, 1.0)
    payload, scales = ref.quantize_int8(x, 32)
    coarse = np.round(payload.astype(np.int32) / 4) * 4
    worse = ref.dequantize_int8(coarse.astype(np.int8), scales, 32, x.size)
    assert np.any(np.abs(worse - x) > ref.error_bound(x, "int8", 32))


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_error_feedback_identity(compression):
    """Over steps, sum(transmitted) + residual = sum(inputs): float64 exactly for the reference,
    within float32 rounding of the running sums for the jnp path."""
    steps, block = 20, 32
    xs = [_gradient_like(500, 1.0, seed) for seed in range(steps)]
    residual, sent_sum = np.zeros(500), np.zeros(500)
    r32, sent32 = jnp.zeros(500), np.zeros(500)
    for x in xs:
        sent, residual = ref.error_feedback_step(x, residual, compression, block)
        sent_sum += sent
        corrected = jnp.asarray(x) + r32
        sent_j = jc.round_trip(corrected, compression, block)
        r32 = corrected - sent_j
        sent32 += np.asarray(sent_j, np.float64)
    total = np.sum(xs, axis=0, dtype=np.float64)
    assert np.max(np.abs(sent_sum + residual - total)) <= 1e-5 * np.max(np.abs(total))
    assert np.max(np.abs(sent32 + np.asarray(r32) - total)) <= 1e-5 * np.max(np.abs(total))
    # and without feedback the same steps lose more than the residual ever holds
    lossy = sum(ref.round_trip(x, compression, block) for x in xs)
    assert np.max(np.abs(lossy - total)) > 10 * np.max(np.abs(sent_sum + residual - total))


@pytest.mark.parametrize("compression", ["bf16", "int8"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_two_stage_exchange_matches_the_reference(compression, replicas):
    """Replicas in a shard_map: every replica holds the same sum; it and each replica's residual
    match the float64 reference; and the residuals owe exactly what the sum lacks."""
    mesh = jax.make_mesh((replicas,), ("data",), devices=jax.devices()[:replicas])
    size, block = 301, 32  # not a multiple of replicas x block: the chunks are padded
    x = np.stack([_gradient_like(size, 1.0, i) for i in range(replicas)])
    r = np.stack([_gradient_like(size, 0.01, 10 + i) for i in range(replicas)])

    def body(xl, rl):
        total, new_r = jc.compressed_sum(xl[0], rl[0], "data", replicas, compression, block)
        return total[None], new_r[None]

    split = jax.sharding.NamedSharding(mesh, P("data"))
    total, new_r = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                                         out_specs=(P("data"), P("data"))))(
        jax.device_put(x, split), jax.device_put(r, split))
    total, new_r = np.asarray(total, np.float64), np.asarray(new_r, np.float64)
    want_total, want_r = ref.two_stage_sum(list(x), list(r), compression, block)
    for i in range(1, replicas):
        np.testing.assert_array_equal(total[0], total[i])
    owed = x.astype(np.float64) + r
    # float32 sums may round a stage-2 input across a rounding boundary: one step of stage 2
    chunk = ref.chunk_size(size, replicas, compression, block)
    shards = np.zeros(replicas * chunk)
    shards[:size] = owed.sum(axis=0)
    step2 = 2 * ref.error_bound(shards, compression, block)[:size] + 1e-6
    assert np.all(np.abs(total[0] - want_total) <= step2)
    # the identity error feedback rests on: sum(residuals) + sum received = sum(owed)
    np.testing.assert_allclose(new_r.sum(axis=0) + total[0], owed.sum(axis=0), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.sum(want_r, axis=0) + want_total, owed.sum(axis=0), atol=1e-12)
    for i in range(replicas):  # stage 1 may split a tie differently too
        tie = 2 * ref.error_bound(owed[i].astype(np.float32), compression, block) + 1e-6
        assert np.all(np.abs(new_r[i] - want_r[i]) <= tie + step2)
    # the sum is off by at most both stages' bounds
    stage1 = sum(ref.error_bound(owed[i].astype(np.float32), compression, block)
                 for i in range(replicas))
    assert np.all(np.abs(total[0] - owed.sum(axis=0)) <= stage1 + step2)


# -- the compiled step -------------------------------------------------------------------------
REPLICAS = (2, 4, 8)
MICRO = "batch.micro_batch=8"  # 2 micro-batches: `none` takes the same once-per-step path


def _data_parallel_job(replicas: int, *overrides: str, init: bool = False):
    """The tiny job on the first `replicas` devices, one data-parallel replica on each."""
    spec = tiny_spec(MICRO, f"mesh.axes.data.size={replicas}", "mesh.axes.fsdp.size=1",
                     "mesh.axes.tensor.size=1", *overrides)
    return build_job(spec, mesh=build_mesh(spec, jax.devices()[:replicas]), init=init)


def _data_bus_bytes_by_kind(job, batch) -> dict[str, float]:
    """Compile the job's step; bus bytes per step over the data axis, by collective kind."""
    volume = analyze_compiled(job.step.compile(job.state or job.abstract_state, batch),
                              job.step.mesh)
    by_kind = {}
    for c in volume.collectives:
        if c.axes == ("data",):
            by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.bus_bytes_per_step
    return by_kind


@pytest.fixture(scope="module")
def compiled_jobs():
    """(replicas, compression) -> (job, bus bytes per step of each collective kind over the data
    axis, gradient elements per device). The 2-replica jobs have taken one step."""
    out = {}
    for replicas in REPLICAS:
        for compression in ("none", "bf16", "int8"):
            job = _data_parallel_job(replicas, f'collectives.compression="{compression}"',
                                     init=replicas == 2)
            batch = job.step.shard_batch(job.data.batch(0))
            by_kind = _data_bus_bytes_by_kind(job, batch)
            elements = sum(x.size for x in jax.tree.leaves(job.abstract_state.params))
            if job.state is not None:
                job.state, _ = job.step(job.state, batch)
            out[replicas, compression] = (job, by_kind, elements)
    return out


@pytest.mark.parametrize("replicas", REPLICAS)
def test_gradient_bytes_shrink_by_the_claimed_factor(compiled_jobs, replicas):
    """From the compiled step's HLO: `none` all-reduces the float32 gradient, 2(n-1)/n * 4S bus
    bytes; the compressed options move 2(n-1)/n of their padded chunks (all-to-all, then
    all-gather): 2x less for bf16, 4x less plus the scales and the padding for int8."""
    _, none, elements = compiled_jobs[replicas, "none"]
    factor = 2 * (replicas - 1) / replicas
    assert set(none) == {"all-reduce"} and none["all-reduce"] >= factor * 4 * elements
    for compression, bytes_per_element in (("bf16", 2), ("int8", 1 + 4 / 256)):
        moved = compiled_jobs[replicas, compression][1]
        chunk = ref.chunk_size(elements, replicas, compression, 256)
        exchange = moved["all-to-all"] + moved["all-gather"]
        assert exchange == pytest.approx(factor * replicas * chunk * bytes_per_element, abs=1e-6)
        assert moved.get("all-reduce", 0) <= factor * 32  # loss and token sums only
        ratio = none["all-reduce"] / sum(moved.values())
        if compression == "bf16":
            assert 1.98 <= ratio <= 2.0 + 1e-9, ratio
        else:  # padding to whole 256-blocks per chunk: up to 8% of this tiny model
            assert 3.5 <= ratio <= 4.0, ratio


def test_residual_is_per_replica_state(compiled_jobs):
    for compression in ("bf16", "int8"):
        state = compiled_jobs[2, compression][0].state
        params, residual = state.params, state.ef_residual
        for p, r in zip(jax.tree.leaves(params), jax.tree.leaves(residual)):
            assert r.shape == (2, *p.shape) and r.dtype == jnp.float32
            assert r.sharding.spec[0] in ("data", ("data",))
        assert any(float(jnp.max(jnp.abs(r))) > 0 for r in jax.tree.leaves(residual))
    assert not hasattr(compiled_jobs[2, "none"][0].state, "ef_residual")


def test_without_error_feedback_the_state_has_no_residual(compiled_jobs):
    """error_feedback = false: no residual in the state, the same exchange bytes, and the step
    trains."""
    job = _data_parallel_job(2, 'collectives.compression="int8"', "collectives.error_feedback=false",
                             init=True)
    assert not hasattr(job.state, "ef_residual")
    batch = job.step.shard_batch(job.data.batch(0))
    moved, with_feedback = _data_bus_bytes_by_kind(job, batch), compiled_jobs[2, "int8"][1]
    for kind in ("all-to-all", "all-gather"):
        assert moved[kind] == with_feedback[kind]
    state, metrics = job.step(job.state, batch)
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1


@pytest.mark.parametrize("setting,field", [
    ('collectives.compression="fp8"', "collectives.compression"),
    ("collectives.compression_block=6", "collectives.compression_block"),
    ("collectives.compression_block=0", "collectives.compression_block"),
])
def test_bad_input_is_one_line_naming_the_field(setting, field, capsys):
    assert main(["validate", str(DEFAULT_SPEC_PATH), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and field in err and "Traceback" not in err


def test_resume_with_other_compression_is_one_line_naming_the_field(tmp_path):
    """The residual is state: a checkpoint without it cannot resume a compressed run."""
    spec = tiny_spec("checkpoint.interval=1")
    ckpt = Checkpointer(spec, tmp_path)
    ckpt.save(1, build_job(spec).state, total_steps=2)
    ckpt.wait()
    other = tiny_spec("checkpoint.interval=1", 'collectives.compression="int8"')
    with pytest.raises(UserInputError, match=r"^collectives\.compression: .*'none', the spec says 'int8'"):
        Checkpointer(other, tmp_path).restore_latest(build_job(other, init=False).abstract_state)


def test_residual_is_checkpointed_and_resharded(compiled_jobs, tmp_path):
    """Saved with data=2 on 2 devices, restored onto data=2 x fsdp=2 x tensor=2: same values."""
    job = compiled_jobs[2, "int8"][0]
    state, spec = job.state, job.spec
    ckpt = Checkpointer(spec, tmp_path)
    ckpt.save(1, state, total_steps=2)
    ckpt.wait()
    other = spec.model_copy(update={"mesh": load_spec(None, [
        "mesh.axes.data.size=2", "mesh.axes.fsdp.size=2", "mesh.axes.tensor.size=2"]).mesh})
    target = build_job(other, init=False)
    restored, _ = Checkpointer(other, tmp_path).restore_latest(target.abstract_state)
    for saved, got, want in zip(jax.tree.leaves(state.ef_residual),
                                jax.tree.leaves(restored.ef_residual),
                                jax.tree.leaves(target.abstract_state.ef_residual)):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))


def test_resume_onto_another_replica_count_folds_the_residuals(compiled_jobs, tmp_path):
    """2 replicas' residuals restored onto 8: their sum (what error feedback owes) becomes
    replica 0's residual, the others start at zero, and the restored state trains on."""
    saved_job = compiled_jobs[2, "int8"][0]
    ckpt = Checkpointer(saved_job.spec, tmp_path)
    ckpt.save(1, saved_job.state, total_steps=2)
    ckpt.wait()
    replicas = 8
    job = compiled_jobs[replicas, "int8"][0]
    restored, _ = Checkpointer(job.spec, tmp_path).restore_latest(job.abstract_state)
    for saved, got, want in zip(jax.tree.leaves(saved_job.state.ef_residual),
                                jax.tree.leaves(restored.ef_residual),
                                jax.tree.leaves(job.abstract_state.ef_residual)):
        assert got.shape == (replicas, *saved.shape[1:]) and got.sharding == want.sharding
        got = np.asarray(got)
        np.testing.assert_array_equal(got[0], np.sum(np.asarray(saved), axis=0, dtype=np.float32))
        assert not np.any(got[1:])
    for saved, got in zip(jax.tree.leaves(saved_job.state.params), jax.tree.leaves(restored.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
    state, metrics = job.step(restored, job.step.shard_batch(job.data.batch(1)))
    assert np.isfinite(float(metrics["loss"]))
    assert int(state.step) == int(saved_job.state.step) + 1
