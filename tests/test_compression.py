"""collectives.compression: quantizers against the float64 reference (spec_jax.core.compression),
the error-feedback identity, the gradient bytes of the compiled step, and bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spec_jax.checkpoint import Checkpointer
from spec_jax.cli.main import main
from spec_jax.collectives import compression as jc
from spec_jax.core import compression as ref
from spec_jax.core.errors import UserInputError
from spec_jax.core.spec import DEFAULT_SPEC_PATH, load_spec
from spec_jax.metrics.comm import analyze_compiled
from spec_jax.train import build_job
from tiny import tiny_spec

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
def test_compressed_sum_over_replicas_matches_the_reference(compression):
    """Two replicas in a shard_map: the sum is the reference's transmitted values summed in
    rank order, and each replica keeps its own residual."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    x = np.stack([_gradient_like(300, 1.0, 1), _gradient_like(300, 1.0, 2)])
    r = np.stack([_gradient_like(300, 0.01, 3), _gradient_like(300, 0.01, 4)])

    def body(xl, rl):
        total, new_r = jc.compressed_sum(xl[0], rl[0], "data", compression, 32)
        return total[None], new_r[None]

    split = jax.sharding.NamedSharding(mesh, P("data"))
    total, new_r = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                                         out_specs=(P("data"), P("data"))))(
        jax.device_put(x, split), jax.device_put(r, split))
    total, new_r = np.asarray(total), np.asarray(new_r)
    sent = [ref.error_feedback_step(x[i], r[i].astype(np.float64), compression, 32) for i in (0, 1)]
    tol = 2 * ref.error_bound(x[0] + r[0], compression, 32) + 1e-6  # a tie split differently
    np.testing.assert_array_equal(total[0], total[1])
    assert np.all(np.abs(total[0] - (sent[0][0] + sent[1][0])) <= 2 * tol)
    for i in (0, 1):
        assert np.all(np.abs(new_r[i] - sent[i][1]) <= tol)


# -- the compiled step -------------------------------------------------------------------------
MESH = ["mesh.axes.data.size=2", "mesh.axes.fsdp.size=4", "mesh.axes.tensor.size=1",
        "batch.micro_batch=8"]  # 2 micro-batches: the explicit, once-per-step reduction


@pytest.fixture(scope="module")
def data_axis_traffic():
    """compression -> (bus bytes per step over the data axis, gradient elements per replica
    device, the state after one step, the spec)."""
    out = {}
    for compression in ("none", "bf16", "int8"):
        job = build_job(tiny_spec(*MESH, f'collectives.compression="{compression}"'))
        batch = job.step.shard_batch(job.data.batch(0))
        volume = analyze_compiled(job.step.compile(job.state, batch), job.step.mesh)
        elements = sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(job.state.params))
        state, _ = job.step(job.state, batch)
        out[compression] = (sum(c.bus_bytes_per_step for c in volume.collectives
                                if c.axes == ("data",)), elements, state, job.spec)
    return out


def test_gradient_bytes_shrink_by_the_claimed_factor(data_axis_traffic):
    none, elements = data_axis_traffic["none"][:2]
    assert none >= 4 * elements  # the float32 gradient all-reduce (plus a few scalars)
    scalars = none - 4 * elements
    bf16 = data_axis_traffic["bf16"][0]
    assert 1.98 <= none / bf16 <= 2.0 + 1e-9, (none, bf16)
    # int8: one byte per element of whole blocks, a float32 scale per block
    block = 256
    blocks = -(-elements // block)
    int8_bytes = blocks * block + 4 * blocks
    assert data_axis_traffic["int8"][0] <= int8_bytes + scalars + 16
    assert 3.5 <= none / data_axis_traffic["int8"][0] <= 4.0, (none, data_axis_traffic["int8"][0])


def test_residual_is_per_replica_state(data_axis_traffic):
    for compression in ("bf16", "int8"):
        state = data_axis_traffic[compression][2]
        params, residual = state.params, state.ef_residual
        for p, r in zip(jax.tree.leaves(params), jax.tree.leaves(residual)):
            assert r.shape == (2, *p.shape) and r.dtype == jnp.float32
            assert r.sharding.spec[0] in ("data", ("data",))
        assert any(float(jnp.max(jnp.abs(r))) > 0 for r in jax.tree.leaves(residual))
    assert not hasattr(data_axis_traffic["none"][2], "ef_residual")


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


def test_residual_is_checkpointed_and_resharded(data_axis_traffic, tmp_path):
    """Saved with data=2 x fsdp=4, restored onto data=2 x fsdp=2 x tensor=2: same values."""
    state, spec = data_axis_traffic["int8"][2:]
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
