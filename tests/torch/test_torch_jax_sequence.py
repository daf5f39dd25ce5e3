"""JAX = torch for a context layout and a MoE layout: the torch run (4 gloo ranks) started from
the JAX run's initial parameters (4 of the 8 simulated devices, the same layout) follows its
per-step loss and gradient norm within 1e-5 over 10 steps on the same ragged batches; with
capacity-limited routing the dropped assignments and the expert load are equal, step by step;
with context parallelism beside 2 data replicas, the gradient noise scale's per-step parts
(over the replicas, each replica's gradient whole over its context ranks) are JAX's within
1e-4, as on the dense layouts (tests/torch/test_torch_features.py)."""
import jax
import numpy as np
import pytest

from sequence_job import RANKS, run_layouts
from trainspec.core.golden import ragged_batch
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.jax.mesh import build_mesh
from trainspec.jax.train import build_job
from tiny import TINY

pytestmark = pytest.mark.slow

STEPS, RTOL = 10, 1e-5
SETS = [*TINY, "optimizer.grad_clip_norm=1.0"]
LAYOUTS = {
    "context": ["mesh.axes.data.size=2", "mesh.axes.context.size=2"],
    "moe": ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.capacity_factor=0.5",
            "batch.global_batch=8", "batch.micro_batch=8", "mesh.axes.data.size=1",
            "mesh.axes.expert.size=4", "metrics.gns=false"],
}


def _jax_run(overrides):
    spec = load_spec(DEFAULT_SPEC_PATH, [*SETS, *overrides])
    job = build_job(spec, mesh=build_mesh(spec, jax.devices()[:RANKS]), total_steps=STEPS)
    params = jax.device_get(job.state.params)
    state, record = job.state, {}
    for step in range(STEPS):
        state, metrics = job.step(state, ragged_batch(job.data, step))
        for key in ("loss", "grad_norm", "gns_grad_sq", "gns_trace"):
            if key in metrics:
                record.setdefault(key, []).append(float(metrics[key]))
        for key, value in metrics.get("aux", {}).items():
            record.setdefault(key, []).append(np.asarray(value).tolist())
    flat = {"/".join(str(k.key) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    return flat, record


@pytest.fixture(scope="module", params=list(LAYOUTS))
def both(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    params, jax_record = _jax_run(LAYOUTS[request.param])
    np.savez(tmp / "params.npz", **params)
    torch_record = run_layouts(tmp, {request.param: [*SETS, *LAYOUTS[request.param]]}, STEPS,
                               params=tmp / "params.npz")[request.param]
    return request.param, jax_record, torch_record


def test_torch_follows_jax_from_the_same_start(both):
    layout, jax_record, torch_record = both
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
    if layout == "moe":
        assert all(d > 0 for d in jax_record["moe_dropped"])
        assert torch_record["moe_dropped"] == jax_record["moe_dropped"]
        assert torch_record["moe_load"] == jax_record["moe_load"]
