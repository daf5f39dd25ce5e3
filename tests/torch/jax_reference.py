"""The JAX side of the torch-against-JAX tests run in the test's own process: the reference job
on the first `devices` of the 8 simulated devices, trained on the ragged batches the torch
workers train on (trainspec.core.golden.ragged_batch)."""
import jax
import numpy as np

from trainspec.core.golden import ragged_batch
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.jax.mesh import build_mesh
from trainspec.jax.train import build_job

RECORDED = ("loss", "grad_norm", "gns_grad_sq", "gns_trace")


def jax_trajectory(sets: list[str], steps: int,
                   devices: int) -> tuple[dict[str, np.ndarray], dict[str, list]]:
    """(the initial parameters flat, {"a/b": array}, as the torch workers load them; the record:
    each step's RECORDED metrics that the step reports and its aux metrics, as lists)."""
    spec = load_spec(DEFAULT_SPEC_PATH, sets)
    job = build_job(spec, mesh=build_mesh(spec, jax.devices()[:devices]), total_steps=steps)
    flat = {"/".join(str(k.key) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(
                jax.device_get(job.state.params))[0]}
    state, record = job.state, {}
    for step in range(steps):
        state, metrics = job.step(state, ragged_batch(job.data, step))
        for key in RECORDED:
            if key in metrics:
                record.setdefault(key, []).append(float(metrics[key]))
        for key, value in metrics.get("aux", {}).items():
            record.setdefault(key, []).append(np.asarray(value).tolist())
    return flat, record
