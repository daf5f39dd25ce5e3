"""The planner's prediction for a spec held to the program XLA:CPU compiles for it
(tests/jax/test_plan_compiled.py, tests/jax/test_plan_grid.py; docs/plan.md)."""
from trainspec.core.plan.hardware import load_profile
from trainspec.core.plan.memory import peak_phase
from trainspec.jax.tools.plan_check import compile_layout, predict_for

MEMORY_TOL, COMM_TOL = 0.10, 0.02
CPU = load_profile("cpu")


# A collective of a few scalars a step (the MoE layers' auxiliary losses, which XLA reduces over
# the expert axis on their own beside a data axis: 8 float32 on the layouts checked) is held
# to this many bytes absolutely: its bytes move no prediction, a relative error on 32 would.
SCALAR_BYTES = 256


def _comm_errors(predicted: dict, hlo: dict) -> dict:
    keys = {(k, a) for d in (predicted, hlo) for k in d for a in d[k]}
    errors = {}
    for k, a in keys:
        plan, compiled = predicted.get(k, {}).get(a, 0.0), hlo.get(k, {}).get(a, 0.0)
        small = max(plan, compiled) <= SCALAR_BYTES
        errors[f"{k}@{a}"] = 0.0 if small else plan / max(compiled, 1e-9) - 1
    return errors


def check_against_compiled(spec, n_devices: int, label: str, got: dict | None = None) -> None:
    """Compile the step for its abstract state (nothing runs; or take `got`, compile_layout's
    result for it) and assert the plan's memory within 10% of the compiled program's, its
    communication within 2% per collective kind and mesh axis of the HLO's, and as many
    all-gathers as the step executes; print a PLANROW line with the figures (`pytest -s`)."""
    got = got or compile_layout(spec, n_devices)
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
    executed = got["comm_ops_by_kind"].get("all-gather", 0)
    assert gathers == executed, (gathers, got["comm_ops_by_kind"])
    assert abs(mem) <= MEMORY_TOL, (pred.memory, got["memory_peak_bytes"])
