"""The planners against the programs XLA:CPU compiles for the reference job with context and
expert axes (docs/plan.md, "Context and expert layouts"), each program compiled once for its
abstract state (nothing runs) and shared by both checks:
- the XLA:CPU planner (trainspec.core.plan.model): memory within 10%, communication within 2%
  per collective kind and mesh axis (tests/jax/plan_vs_compiled.py), on context 2, 4 and
  2 x data 2 (ring and all_gather) and expert 2, 4 and 2 x data 2 (dropless; and capacity
  1.25 beside data), float32 compute, and context 2 and expert 2 with bfloat16 compute;
- the sharded-decoder planner's ring and all-to-all bytes (trainspec.core.plan.sharded_decoder),
  with and without full remat, whose recomputation runs the forward ring again.
The validation model (d_model 128, 8 heads, d_ff 256, 1 layer, T 32; its MoE variant 4
experts, 2 a token), 2 micro-batches of 8 rows a step; beside a data axis an expert axis
takes one micro-batch (accumulation is refused there), of 16 rows.
"""
import functools

import pytest

from plan_vs_compiled import check_against_compiled
from trainspec.core.decoder_shape import reference_shape
from trainspec.core.plan.sharded_decoder import Layout, Precision, comm_bytes
from trainspec.core.spec import load_spec
from trainspec.jax.tools.plan_check import VALIDATION_MODEL, compile_layout

pytestmark = pytest.mark.slow

F32 = Precision(param=4, grad=4, optimizer=8, activation=4)
MOE = ["model.moe.experts=4", "model.moe.top_k=2"]
# label -> (mesh axis sizes, overrides)
LAYOUTS = {
    **{f"context {c}{' x data 2' if d > 1 else ''} {attention}": (
        {"data": d, "context": c}, [f'context.attention="{attention}"'])
       for attention in ("ring", "all_gather") for d, c in ((1, 2), (1, 4), (2, 2))},
    "context 4 ring full remat": ({"data": 1, "context": 4}, ['remat.policy="full"']),
    **{f"expert {e}{' x data 2' if d > 1 else ''} dropless": (
        {"data": d, "expert": e}, [*MOE, "model.moe.capacity_factor=0"])
       for d, e in ((1, 2), (1, 4), (2, 2))},
    # the capacity bound decides which rows are zeros, not a buffer or a collective: the same
    # memory and bytes as dropless (docs/plan.md), checked on one layout
    "expert 2 x data 2 capacity 1.25": ({"data": 2, "expert": 2},
                                        [*MOE, "model.moe.capacity_factor=1.25"]),
    "context 2 ring bfloat16": ({"data": 1, "context": 2}, ['precision.compute="bfloat16"']),
    "expert 2 dropless bfloat16": ({"data": 1, "expert": 2},
                                   [*MOE, 'precision.compute="bfloat16"']),
}


def spec_of(label: str):
    axes, overrides = LAYOUTS[label]
    micro = 16 if axes["data"] > 1 and "expert" in axes else 8
    return load_spec(None, [
        *VALIDATION_MODEL, f"batch.micro_batch={micro}", "batch.global_batch=16",
        "metrics.gns=false", *overrides,
        *(f"mesh.axes.{a}.size={s}" for a, s in {"fsdp": 1, "tensor": 1, **axes}.items())])


def devices(label: str) -> int:
    sizes = LAYOUTS[label][0].values()
    return functools.reduce(lambda a, b: a * b, sizes)


@functools.cache
def compiled(label: str) -> dict:
    return compile_layout(spec_of(label), devices(label))


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_plan_matches_the_compiled_step(label):
    check_against_compiled(spec_of(label), devices(label), label, compiled(label))


@pytest.mark.parametrize("label, kind, role", [
    ("context 4 ring", "collective-permute", "context"),
    ("context 4 ring full remat", "collective-permute", "context"),
    ("expert 4 dropless", "all-to-all", "expert"),
])
def test_sharded_decoder_ring_and_dispatch_bytes_match_the_compiled_step(label, kind, role):
    spec = spec_of(label)
    axes = LAYOUTS[label][0]
    shape = reference_shape(spec.model)
    k = spec.batch.accumulation_steps
    per_replica = spec.batch.micro // (axes["data"] * axes.get("expert", 1))
    plan = comm_bytes(shape, Layout(axes, micro_batch=per_replica, micro_batches=k,
                                    seq_len=spec.batch.seq_len, precision=F32,
                                    dispatch_rows=shape.experts,
                                    full_remat=spec.remat.policy == "full"))
    by_kind = compiled(label)["comm_bytes_by_kind_and_axis"][kind]
    assert plan[role] > 0
    assert sum(by_kind.values()) == pytest.approx(plan[role], rel=0.02), (by_kind, plan)
