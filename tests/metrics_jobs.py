"""Small jobs shared by the metrics tests; each layout is compiled once per test session."""
import functools
import math

import jax

from trainspec.jax.metrics import comm, memory
from trainspec.jax.train import build_job
from tiny import tiny_spec

# d_model 64 and 4 heads split evenly over up to 8 devices; 2 micro-batches (a loop in HLO).
METRICS_MODEL = ["model.d_model=64", "model.n_heads=4", "model.d_ff=128",
                 "batch.micro_batch=8", "train.steps=4"]


@functools.lru_cache(maxsize=None)
def compiled_layout(layout: str, *overrides: str):
    """(job, compiled step, CommVolume, memory fields) of the tiny model under `layout`, compiled
    for the job's abstract state (no state is initialised)."""
    spec = tiny_spec(*METRICS_MODEL, *overrides, layout=layout)
    job = build_job(spec, init=False)
    compiled = job.step.lower(job.abstract_state, job.step.shard_batch(job.data.batch(0))).compile()
    return job, compiled, comm.analyze_compiled(compiled, job.step.mesh), memory.compiled_memory(compiled)


def param_bytes(params, per_device: bool = False) -> int:
    """Bytes of the parameters (arrays or their abstract shapes): whole, or one device's shard."""
    def nbytes(x):
        return math.prod(x.sharding.shard_shape(x.shape) if per_device else x.shape) * x.dtype.itemsize
    return sum(nbytes(x) for x in jax.tree.leaves(params))
