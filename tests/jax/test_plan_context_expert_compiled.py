"""The planner's ring and all-to-all bytes (trainspec/core/plan/sharded_decoder.py) against
the programs XLA:CPU compiles for the reference job: within 2% on a context layout (with and
without full remat, whose recomputation runs the forward ring again) and on an expert layout
(the permutes also carry the key positions, the only difference)."""
import pytest

from trainspec.core.decoder_shape import reference_shape
from trainspec.core.plan.sharded_decoder import Layout, Precision, comm_bytes
from trainspec.jax.train import build_job
from tiny import tiny_spec

pytestmark = pytest.mark.slow

F32 = Precision(param=4, grad=4, optimizer=8, activation=4)


def _compiled_by_kind(spec) -> dict[str, float]:
    job = build_job(spec, total_steps=2)
    batch = job.step.shard_batch(job.data.batch(0))
    return job.step.comm_volume(job.step.compile(job.state, batch)).by_kind()


@pytest.mark.parametrize("axes, kind, role, remat", [
    ({"data": 2, "context": 4}, "collective-permute", "context", "none"),
    ({"data": 2, "context": 4}, "collective-permute", "context", "full"),
    ({"data": 2, "expert": 4}, "all-to-all", "expert", "none"),
])
def test_ring_and_dispatch_bytes_match_the_compiled_step(axes, kind, role, remat):
    spec = tiny_spec("model.n_layers=2", "batch.seq_len=64", "batch.global_batch=8",
                     "batch.micro_batch=8", "metrics.gns=false", "model.moe.experts=4",
                     f'remat.policy="{remat}"',
                     *(f"mesh.axes.{a}.size={s}" for a, s in {"data": 1, "fsdp": 1, "tensor": 1,
                                                              **axes}.items()))
    shape = reference_shape(spec.model)
    per_replica = spec.batch.global_batch // (axes["data"] * axes.get("expert", 1))
    plan = comm_bytes(shape, Layout(axes, micro_batch=per_replica, micro_batches=1,
                                    seq_len=spec.batch.seq_len, precision=F32,
                                    dispatch_rows=shape.experts, full_remat=remat == "full"))
    compiled = _compiled_by_kind(spec)
    assert plan[role] > 0
    assert compiled[kind] == pytest.approx(plan[role], rel=0.02), (compiled, plan)
