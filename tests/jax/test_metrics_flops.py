"""Analytic FLOPs against XLA's cost analysis, and the MFU arithmetic (docs/metrics.md, section 3).

Conventions of the numbers compared:
- model FLOPs: 6 N_non-embedding + 12 L d T per token, no causal discount, every token position;
- hardware FLOPs (analytic): what our implementation runs in matmuls: model FLOPs less the norm
  scales, plus the one-hot embedding matmul (4 V d) and rematerialised forward matmuls;
- XLA FLOPs: `Lowered.cost_analysis()["flops"]` of the whole step before partitioning, all ops
  (elementwise too), the micro-batch loop unrolled into one batch.
"""
import functools

import jax
import pytest

from trainspec.core import flops as core_flops
from trainspec.core.spec import default_spec, load_spec
from trainspec.jax.metrics import flops
from trainspec.core.transformer_flops import for_spec
from trainspec.jax.train import build_job

TOLERANCE = 0.05  # XLA also counts elementwise ops (softmax, gelu, norms, AdamW): +2% measured


@functools.lru_cache(maxsize=None)
def _job(*overrides):
    # Two micro-batches: the accumulating step is a loop, which XLA's cost analysis counts once.
    # Only lowered: its abstract state (`job.abstract_state`) stands in for an initialised one.
    spec = load_spec(None, ["batch.micro_batch=16", *overrides])
    return build_job(spec, init=False)


def test_parameter_formula_matches_the_model():
    job = _job()
    fl = for_spec(job.spec)
    params = job.abstract_state.params
    assert flops.param_count(params) == fl.total_params
    assert params["embedding"].size == fl.embedding_params


# The MoE model on an fsdp axis: an expert axis's shard_map body is one device's work, which
# the cost analysis of the unpartitioned program counts once.
MOE = ("model.moe.experts=4", "metrics.gns=false", "mesh.axes.data.size=1",
       "mesh.axes.fsdp.size=8")


@pytest.mark.parametrize("overrides", [("remat.policy=none",), ("remat.policy=full",), MOE],
                         ids=["none", "full", "moe"])
def test_analytic_hardware_flops_match_xla_cost_analysis(overrides):
    job = _job(*overrides)
    assert job.spec.batch.accumulation_steps == 2
    fl = for_spec(job.spec)
    tokens = core_flops.tokens_per_step(job.spec)
    xla = flops.xla_flops_per_step(job.step, job.abstract_state, job.data.batch(0))
    hardware = fl.hardware_per_token() * tokens
    assert abs(xla / hardware - 1) < TOLERANCE, (xla, hardware)
    model = fl.model_per_token("no_causal_discount") * tokens
    # Model FLOPs leave out the one-hot embedding (and remat), so they sit below XLA's count.
    assert model < xla


def test_xla_counts_a_loop_body_once():
    """Why xla_flops_per_step lowers a loop-free variant: the accumulating step's own cost
    analysis is about one micro-batch. If XLA starts multiplying by the trip count, this fails
    and the re-lowering can go."""
    job = _job()
    direct = job.step.lower(job.abstract_state, job.data.batch(0)).cost_analysis()["flops"]
    whole = flops.xla_flops_per_step(job.step, job.abstract_state, job.data.batch(0))
    assert direct < 0.6 * whole


def test_causal_discount_halves_the_attention_term():
    spec = default_spec()
    fl = for_spec(spec)
    m = spec.model
    full, half = fl.model_per_token("no_causal_discount"), fl.model_per_token("causal_discount")
    assert full - half == 6 * m.n_layers * m.d_model * spec.batch.seq_len
    assert full == 6 * fl.non_embedding_params + 12 * m.n_layers * m.d_model * spec.batch.seq_len


def test_peak_table_and_override():
    assert core_flops.device_kind_key("NVIDIA H100 80GB HBM3") == "H100"
    assert core_flops.device_kind_key("NVIDIA H200") == "H200"
    assert core_flops.device_kind_key("NVIDIA A100-SXM4-40GB") == "A100"
    assert core_flops.device_kind_key("AMD Instinct MI300X") == "MI300X"
    assert core_flops.device_kind_key("TPU v5 lite") == "TPU v5e"
    assert core_flops.device_kind_key("TPU v5p") == "TPU v5p"
    assert core_flops.device_kind_key("cpu") == "cpu"
    assert core_flops.device_kind_key("Some Future Chip") is None
    cpu = flops.peak_flops(default_spec())
    assert cpu.flops_per_device == pytest.approx(core_flops.CPU_PROCESS_PEAK_FLOPS / jax.local_device_count())
    spec = load_spec(None, ["metrics.peak_flops_per_device=1e12"])
    peak = flops.peak_flops(spec)
    assert peak.flops_per_device == 1e12 and "spec" in peak.source
    # 4e12 FLOPs in 1 s on 8 devices of 1e12 FLOP/s: half the machine's peak.
    assert core_flops.utilisation(4e12, 1.0, 8, peak) == pytest.approx(0.5)
    assert core_flops.utilisation(4e12, 1.0, 8, core_flops.Peak(None, "unknown")) is None
