"""The planner (trainspec.core.plan) against what XLA:CPU compiles here (docs/plan.md).

Three sets of programs, each compiled once for its abstract state (nothing runs): every shipped
example (examples/*.toml, on 8 devices, found by glob so that a new example is checked too); a
grid over precision x remat policy x optimizer-state layout x micro-batch on the mixed example's
data x fsdp x tensor layout; and every layout the planner accepts for the validation model at
1-8 devices, with 2 processes x 4 devices through the single-process dcn path (mesh.py lays a
dcn factor out within one process, so the compiled program, its memory and its collectives are
those of the 2 x 4 job). None of them set the CPU profile's memory counts (plan.xla_cpu: read
off another model's buffers). Each asserts per-device memory within 10% of the compiled
program's, communication within 2% per collective kind and mesh axis of its HLO, and as many
all-gathers as it executes; a PLANROW line per program prints the figures (`pytest -s`).
"""
import itertools
from pathlib import Path

import pytest

from trainspec.core.plan.hardware import load_profile
from trainspec.core.plan.memory import peak_phase
from trainspec.core.spec import load_spec
from trainspec.jax.tools.plan_check import (compile_layout, predict_for, validation_layouts,
                                            validation_spec)

pytestmark = pytest.mark.slow

MEMORY_TOL, COMM_TOL = 0.10, 0.02
CPU = load_profile("cpu")
EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.toml"))
MIXED = Path(__file__).parents[1] / "examples" / "mixed.toml"
PRECISIONS = {
    "f32": ["precision.param=float32", "precision.compute=float32", "precision.grad_reduce=float32"],
    "bf16compute": ["precision.param=float32", "precision.compute=bfloat16",
                    "precision.grad_reduce=float32"],
    "bf16": ["precision.param=bfloat16", "precision.compute=bfloat16",
             "precision.grad_reduce=bfloat16"],
}
REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
OPTIMIZER_STATE = ("like_params", "shard_over_data")
MICRO_BATCHES = (8, 32)  # of the global 32: 4 micro-batches a step, and 1
GRID = list(itertools.product(PRECISIONS, REMAT, OPTIMIZER_STATE, MICRO_BATCHES))


def _comm_errors(predicted: dict, hlo: dict) -> dict:
    keys = {(k, a) for d in (predicted, hlo) for k in d for a in d[k]}
    return {f"{k}@{a}": predicted.get(k, {}).get(a, 0.0) / hlo.get(k, {}).get(a, 1e-9) - 1
            for k, a in keys}


def check_against_compiled(spec, n_devices: int, label: str) -> None:
    got = compile_layout(spec, n_devices)
    pred = predict_for(spec, n_devices, CPU)
    assert pred.fits, pred.reasons
    # an all-reduce over no mesh axis (the NaN guard's count on one device) moves nothing
    hlo = {k: {a: b for a, b in v.items() if a != "none"}
           for k, v in got["comm_bytes_by_kind_and_axis"].items()}
    comm = _comm_errors(pred.comm_by_kind_and_axis(), {k: v for k, v in hlo.items() if v})
    mem = pred.memory_bytes / got["memory_peak_bytes"] - 1
    print(f"PLANROW {label} mem {pred.memory_bytes:.0f}/{got['memory_peak_bytes']} ({mem:+.3f}, "
          f"peak phase {peak_phase(pred.memory)}) comm worst "
          f"{max(map(abs, comm.values()), default=0):.4f}")
    assert all(abs(e) <= COMM_TOL for e in comm.values()), comm
    # every all-gather pays its latency: the plan counts each one the step executes
    gathers = sum(c.ops for c in pred.collectives if c.kind == "all-gather")
    assert gathers == got["comm_ops_by_kind"].get("all-gather", 0), (gathers, got["comm_ops_by_kind"])
    assert abs(mem) <= MEMORY_TOL, (pred.memory, got["memory_peak_bytes"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example(example):
    check_against_compiled(load_spec(example), 8, example.stem)


@pytest.mark.parametrize("precision, remat, optimizer_state, micro", GRID,
                         ids=lambda v: str(v))
def test_grid_on_the_mixed_layout(precision, remat, optimizer_state, micro):
    spec = load_spec(MIXED, [*PRECISIONS[precision], f"remat.policy={remat}",
                             f"layout.optimizer_state={optimizer_state}", f"batch.micro_batch={micro}"])
    check_against_compiled(spec, 8, f"mixed {precision} {remat} {optimizer_state} micro={micro}")


@pytest.mark.parametrize("layout", validation_layouts(), ids=lambda l: "d{}f{}t{}dcn{}".format(*l))
def test_every_layout_of_the_validation_model(layout):
    d, f, t, dcn = layout
    check_against_compiled(validation_spec(d, f, t, dcn), d * f * t, f"d={d} f={f} t={t} dcn={dcn}")
