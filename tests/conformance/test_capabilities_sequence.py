"""Context and expert axes and [model.moe] in the capability tables: JAX runs both (experts
routed over the whole micro-batch), torch runs both beside the other axes; what an
implementation does not run is refused by name."""
from trainspec.core.capabilities import Request
from trainspec.core.mesh import resolve_mesh
from trainspec.core.spec import load_spec
from trainspec.jax.capabilities import JAX
from trainspec.torch.capabilities import TORCH


def _refusals(table, data):
    spec = load_spec(data)
    return table.refusals(Request(spec, resolve_mesh(spec, 8)))


CONTEXT = {"mesh": {"axes": {"data": {"size": -1}, "context": {"size": 2}}}}
EXPERT = {"mesh": {"axes": {"data": {"size": -1}, "expert": {"size": 2}}},
          "model": {"moe": {"experts": 4}}}


def test_both_run_a_context_axis_and_torch_refuses_two_in_one_line():
    assert _refusals(JAX, CONTEXT) == [] == _refusals(TORCH, CONTEXT)
    two = {"mesh": {"axes": {"data": {"size": -1}, "context": {"size": 2},
                             "sequence": {"size": 2, "role": "context"}}}}
    lines = _refusals(TORCH, two)
    assert lines == ["mesh.axes.*.size: the torch implementation splits at most one context "
                     "axis, got context=2, sequence=2"], lines


def test_both_run_experts_beside_every_other_axis_and_torch_refuses_semi_sync_by_name():
    assert _refusals(JAX, {**EXPERT, "metrics": {"gns": False}}) == [] == _refusals(TORCH, EXPERT)
    for other in ("fsdp", "tensor", "context"):
        beside = {**EXPERT, "mesh": {"axes": {**EXPERT["mesh"]["axes"], other: {"size": 2}}}}
        assert _refusals(TORCH, beside) == [], other
    lines = _refusals(TORCH, {**EXPERT, "semi_sync": {"inner_steps": 4}})
    assert lines == ["model.moe.experts: the torch implementation routes experts over the whole "
                     "micro-batch, which [semi_sync]'s groups divide: leave [semi_sync] out"], lines


def test_jax_refuses_experts_routed_per_replica():
    """With a split data axis and GNS over replicas on (the default), the step gives the
    model one replica's rows: routing would not be over the micro-batch."""
    lines = _refusals(JAX, EXPERT)
    assert len(lines) == 1 and lines[0].startswith(
        "model.moe.experts: experts route over the whole micro-batch"), lines
