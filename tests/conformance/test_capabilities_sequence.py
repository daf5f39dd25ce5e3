"""Context and expert axes and [model.moe] in the capability tables: JAX runs both (experts
routed over the whole micro-batch), torch runs both beside data axes; what an implementation
does not run is refused by name."""
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


def test_both_run_experts_and_torch_refuses_them_beside_other_axes_by_name():
    assert _refusals(JAX, {**EXPERT, "metrics": {"gns": False}}) == [] == _refusals(TORCH, EXPERT)
    with_fsdp = {**EXPERT, "mesh": {"axes": {**EXPERT["mesh"]["axes"], "fsdp": {"size": 2}}}}
    assert _refusals(TORCH, with_fsdp) == []
    beside = {**EXPERT, "mesh": {"axes": {**EXPERT["mesh"]["axes"], "tensor": {"size": 2}}}}
    lines = _refusals(TORCH, beside)
    assert lines[0] == ("mesh.axes.*.size: the torch implementation splits experts beside data "
                        "and fsdp axes only, got expert=2, tensor=2"), lines
    assert len(lines) == 2 and "leave the tensor axis at 1" in lines[1], lines
    with_context = {**EXPERT, "mesh": {"axes": {**EXPERT["mesh"]["axes"], "context": {"size": 2}}}}
    assert _refusals(TORCH, with_context) == []


def test_jax_refuses_experts_routed_per_replica():
    """With a split data axis and GNS over replicas on (the default), the step gives the
    model one replica's rows: routing would not be over the micro-batch."""
    lines = _refusals(JAX, EXPERT)
    assert len(lines) == 1 and lines[0].startswith(
        "model.moe.experts: experts route over the whole micro-batch"), lines
