"""Context and expert axes and [model.moe] in the capability tables: refused by name where an
implementation does not run them."""
import pytest

from trainspec.core.capabilities import Request
from trainspec.core.mesh import resolve_mesh
from trainspec.core.spec import load_spec
from trainspec.jax.capabilities import JAX
from trainspec.torch.capabilities import TORCH


@pytest.mark.parametrize("table", [JAX, TORCH], ids=lambda t: t.implementation)
def test_implementations_refuse_what_they_do_not_run_by_name(table):
    spec = load_spec({"mesh": {"axes": {"data": {"size": -1}, "context": {"size": 2}}}})
    lines = table.refusals(Request(spec, resolve_mesh(spec, 8)))
    name = table.implementation.replace("jax", "JAX")
    assert len(lines) == 1 and lines[0].startswith(f"mesh.axes.*.size: the {name} implementation "
                                                   "does not split context, expert"), lines
    assert lines[0].endswith(" axes, got context=2"), lines
    moe = load_spec({"model": {"moe": {"experts": 4}}})
    assert table.refusals(Request(moe, resolve_mesh(moe, 8)))[0].startswith("model.moe: ")
