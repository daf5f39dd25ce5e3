"""Communication bytes read from the compiled HLO against the analytic volume of each layout,
and per-device peak memory against the fsdp degree (docs/metrics.md, sections 5 and 6)."""
import pytest

from metrics_jobs import METRICS_MODEL, compiled_layout, param_bytes
from tiny import tiny_spec
from trainspec.jax.metrics.comm import analyze_hlo, axes_of_groups, parse_replica_groups

pytestmark = pytest.mark.slow

K = tiny_spec(*METRICS_MODEL).batch.accumulation_steps  # micro-batches per step: 2
SCALARS = 64  # loss sum, token count and the like reduced with the gradients: a few f32


def test_replica_group_formats_from_real_hlo():
    n = 8
    explicit = "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true"
    assert parse_replica_groups(explicit, n) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    iota = "replica_groups=[4,2]<=[4,2]T(1,0), dimensions={0}"
    assert parse_replica_groups(iota, n) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    mesh = ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) "
            "{'axis_0'}, dimensions={0}")
    assert sorted(map(sorted, parse_replica_groups(mesh, n))) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    plain_mesh = "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2'}, use_global"
    assert parse_replica_groups(plain_mesh, n) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    shape = {"data": 2, "fsdp": 2, "tensor": 2}
    assert axes_of_groups([[0, 2], [4, 6], [1, 3], [5, 7]], shape) == ("fsdp",)
    assert axes_of_groups([[0, 1, 2, 3], [4, 5, 6, 7]], shape) == ("fsdp", "tensor")
    assert axes_of_groups([[0, 7], [1, 6], [2, 5], [3, 4]], shape) == ("?",)


def test_loop_trip_count_multiplies_and_reduce_scatter_counts_its_input():
    hlo = """HloModule m
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %rs = f32[4]{0} reduce-scatter(%x), channel_id=2, replica_groups={{0,1}}, dimensions={0}
}
ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ag = f32[16]{0} all-gather(%a), channel_id=3, replica_groups={{0,1}}, dimensions={0}
}
"""
    v = analyze_hlo(hlo, {"data": 2})
    assert v.by_kind() == {"all-reduce": 3 * 32, "reduce-scatter": 3 * 32, "all-gather": 64}
    assert v.by_axis() == {"data": 3 * 32 + 3 * 32 + 64}
    assert v.bus_bytes == pytest.approx(3 * 32 * 1.0 + 3 * 32 * 0.5 + 64 * 0.5)


def test_data_parallel_is_one_gradient_all_reduce_per_step():
    job, _, volume, _ = compiled_layout("data")
    p = param_bytes(job.abstract_state.params)
    # K > 1 micro-batches are accumulated per replica and reduced once (step.py), not per
    # micro-batch: one all-reduce of the fused gradient buffer, plus a few scalars.
    assert K > 1
    assert set(volume.by_kind()) == {"all-reduce"}
    got = volume.by_kind_and_axis()["all-reduce"]["data"]
    assert p <= got <= p + SCALARS, (got, p)


def test_fsdp_gathers_params_once_and_reduces_gradients_per_micro_batch():
    job, _, volume, _ = compiled_layout("fsdp8")
    p = param_bytes(job.abstract_state.params)
    kinds = volume.by_kind_and_axis()
    # Gathered weights are loop-invariant: XLA hoists the all-gather out of the micro-batch loop.
    assert p <= kinds["all-gather"]["fsdp"] <= 1.01 * p
    # The gradient reduce-scatter: XLA:CPU emits it as all-reduce + dynamic-slice (same S).
    reduced = kinds.get("all-reduce", {}).get("fsdp", 0) + kinds.get("reduce-scatter", {}).get("fsdp", 0)
    assert K * p <= reduced <= K * (p + SCALARS) * 1.01


def test_tensor_parallel_all_reduces_activations():
    job, _, volume, _ = compiled_layout("tensor")
    spec = job.spec
    m, b = spec.model, spec.batch
    rows = b.micro // job.mesh_shape["data"]
    act = rows * b.seq_len * m.d_model * 4
    # Per micro-batch on `tensor`: forward: embedding (vocab-split table), attention out, MLP out;
    # backward: input grads of head, mlp_in and of q, k, v separately -> 2 + 6 L activations,
    # plus the vocab-split softmax's row reductions (a few rows x seq floats).
    expected = K * (2 + 6 * m.n_layers) * act
    kinds = volume.by_kind_and_axis()
    assert expected <= kinds["all-reduce"]["tensor"] <= expected * 1.05
    local = param_bytes(job.abstract_state.params, per_device=True)
    assert local <= kinds["all-reduce"]["data"] <= (local + SCALARS) * 1.01  # once per step


def test_ext_custom_calls_count_like_xla_collectives():
    # As the compiled HLO prints xla_ext's calls (trainspec.jax.collectives.ext); the second has
    # no axes scope, so its axes come from the one axis set of size 4 (`b`).
    call = ('custom-call(%x, %r, %g), custom_call_target="{t}", api_version=API_VERSION_TYPED_FFI, '
            'metadata={{op_name="jit(f)/shard_map/{scope}ffi_call"}}, backend_config={{call_site = 0 '
            ': i64, group_size = {n} : i64, timeout_ms = 1000 : i64}}')
    hlo = f"""HloModule m
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %rs = f32[4]{{0}} {call.format(t="trainspec_reduce_scatter", scope="trainspec_axes=a/", n=2)}
}}
ENTRY %main (a: f32[8]) -> f32[8] {{
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  %ag = f32[32]{{0}} {call.format(t="trainspec_all_gather", scope="", n=4)}
  %bc = f32[8]{{0}} {call.format(t="trainspec_broadcast", scope="trainspec_axes=a+b/", n=8)}
  %other = f32[8]{{0}} custom-call(%a), custom_call_target="SomethingElse"
}}
"""
    v = analyze_hlo(hlo, {"a": 2, "b": 4})
    assert v.by_kind_and_axis() == {"reduce-scatter": {"a": 3 * 32}, "all-gather": {"b": 128},
                                    "broadcast": {"a+b": 32}}
    assert v.bus_bytes == pytest.approx(3 * 32 * 0.5 + 128 * 0.75 + 32 * 1.0)
    # Three axis sets fit a group of 2 without a scope: named "?" rather than guessed.
    ambiguous = analyze_hlo(hlo.replace("trainspec_axes=a/", ""), {"a": 2, "b": 2, "c": 2})
    assert ambiguous.by_kind_and_axis()["reduce-scatter"] == {"?": 3 * 32}


@pytest.mark.parametrize("policy", ["rollback", "skip"])
def test_ext_gradient_all_reduce_moves_the_same_bytes_as_xla(policy):
    """The same data-parallel step through XLA's all-reduce and through xla_ext's custom call.
    XLA folds the step's few scalars (loss sum, tokens) into the gradient all-reduce; with ext
    they stay a separate small XLA all-reduce, so the collectives differ in number, not bytes.
    The NaN guard adds no collective under rollback (each device flags its own slices); under
    skip it all-reduces its verdict, one int32, after the update."""
    nan = f"health.nan.policy={policy}"
    job, _, xla_volume, _ = compiled_layout("data", nan)
    _, _, ext_volume, _ = compiled_layout("data", "collectives.backend=ext", nan)
    p = param_bytes(job.abstract_state.params)
    sizes = sorted(c.bytes for c in ext_volume.collectives)
    # the custom call (the gradient), the scalars, under skip the guard's verdict
    assert sizes[-1] == p
    assert (sizes[0] == 4) == (policy == "skip")
    assert len(sizes) == (3 if policy == "skip" else 2)
    assert ext_volume.by_kind_and_axis() == xla_volume.by_kind_and_axis()
    assert ext_volume.bus_bytes == pytest.approx(xla_volume.bus_bytes)


def test_peak_memory_per_device_falls_as_fsdp_grows():
    peaks = [compiled_layout(name)[3]["memory_peak_bytes"] for name in ("data", "fsdp2", "fsdp4", "fsdp8")]
    assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks
