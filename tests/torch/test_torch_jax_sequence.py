"""JAX = torch for a context layout and two MoE layouts (experts over an expert axis beside
fsdp, which shards the rest of the model; and beside a context axis, where the capacity drops
tokens in the split sequence's order): the torch run (4 gloo ranks) started from
the JAX run's initial parameters (4 of the 8 simulated devices, the same layout) follows its
per-step loss and gradient norm within 1e-5 over 10 steps on the same ragged batches; with
capacity-limited routing the dropped assignments and the expert load are equal, step by step;
with context parallelism beside 2 data replicas, the gradient noise scale's per-step parts
(over the replicas, each replica's gradient whole over its context ranks) are JAX's within
1e-4, as on the dense layouts (tests/torch/test_torch_features.py). One 4-rank torch job
trains every layout, each from its own JAX run's parameters."""
import numpy as np
import pytest

from jax_reference import jax_trajectory
from sequence_job import RANKS, run_layouts
from tiny import TINY

pytestmark = pytest.mark.slow

STEPS, RTOL = 10, 1e-5
SETS = [*TINY, "optimizer.grad_clip_norm=1.0"]
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.capacity_factor=0.5",
       "batch.global_batch=8", "batch.micro_batch=8", "mesh.axes.data.size=1", "metrics.gns=false"]
LAYOUTS = {
    "context": ["mesh.axes.data.size=2", "mesh.axes.context.size=2"],
    "moe": [*MOE, "mesh.axes.fsdp.size=2", "mesh.axes.expert.size=2"],
    "moe_context": [*MOE, "mesh.axes.context.size=2", "mesh.axes.expert.size=2"],
}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """layout -> (the JAX run's record, the torch run's record)."""
    tmp = tmp_path_factory.mktemp("sequence")
    jax_records, params = {}, {}
    for name, sets in LAYOUTS.items():
        flat, jax_records[name] = jax_trajectory([*SETS, *sets], STEPS, RANKS)
        params[name] = tmp / f"{name}_params.npz"
        np.savez(params[name], **flat)
    torch_records = run_layouts(tmp, {name: [*SETS, *sets] for name, sets in LAYOUTS.items()},
                                STEPS, params=params)
    return {name: (jax_records[name], torch_records[name]) for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torch_follows_jax_from_the_same_start(records, layout):
    jax_record, torch_record = records[layout]
    for key in ("loss", "grad_norm"):
        got, want = np.array(torch_record[key]), np.array(jax_record[key])
        print(f"{layout} {key}: largest relative difference "
              f"{np.max(np.abs(got - want) / np.abs(want)):.2e}")
        np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=key)
    if layout == "context":
        for part in ("gns_grad_sq", "gns_trace"):
            got, want = np.array(torch_record[part]), np.array(jax_record[part])
            print(f"context {part}: largest relative difference "
                  f"{np.max(np.abs(got - want) / np.abs(want)):.2e}")
            np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=part)
    if layout.startswith("moe"):
        assert all(d > 0 for d in jax_record["moe_dropped"])
        assert torch_record["moe_dropped"] == jax_record["moe_dropped"]
        assert torch_record["moe_load"] == jax_record["moe_load"]
