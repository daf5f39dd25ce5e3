"""Small jobs shared by the metrics tests; each layout is compiled once per test session."""
import functools

import jax

from spec_jax.metrics import comm, memory
from spec_jax.train import build_job
from tiny import tiny_spec

# d_model 64 and 4 heads split evenly over up to 8 devices; 2 micro-batches (a loop in HLO).
METRICS_MODEL = ["model.d_model=64", "model.n_heads=4", "model.d_ff=128",
                 "batch.micro_batch=8", "train.steps=4"]


@functools.lru_cache(maxsize=None)
def compiled_layout(layout: str, *overrides: str):
    """(job, compiled step, CommVolume, memory fields) of the tiny model under `layout`."""
    spec = tiny_spec(*METRICS_MODEL, *overrides, layout=layout)
    job = build_job(spec)
    compiled = job.step.lower(job.state, job.step.shard_batch(job.data.batch(0))).compile()
    return job, compiled, comm.analyze_compiled(compiled, job.step.mesh), memory.compiled_memory(compiled)


def param_bytes(params, per_device: bool = False) -> int:
    """Bytes of the parameters: whole, or the shard one device holds."""
    if per_device:
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
    return sum(x.nbytes for x in jax.tree.leaves(params))
