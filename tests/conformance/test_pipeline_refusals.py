"""The torch implementation, which does not run pipeline stages, says so in one line before
anything starts, and leaves a one-stage spec alone (the capability table:
trainspec/core/capabilities.py). The JAX implementation's pipeline: tests/jax/test_pipeline.py."""
from __future__ import annotations

from trainspec.core.capabilities import Request
from trainspec.core.mesh import resolve_mesh
from trainspec.core.spec import load_spec
from trainspec.torch.capabilities import TORCH


def spec(stages: int):
    return load_spec('mesh.axes = {data = {size = -1}, stage = {role = "pipeline", size = %d}}\n'
                     "[model]\nn_layers = 2\n" % stages)


def test_torch_refuses_a_split_pipeline_axis():
    table = TORCH
    s = spec(2)
    lines = table.refusals(Request(s, resolve_mesh(s, 4)))
    assert any(line.startswith("mesh.axes.*.size: the ") and "pipeline axes, got stage=2" in line
               for line in lines), lines
    one_stage = spec(1)
    assert not table.refusals(Request(one_stage, resolve_mesh(one_stage, 4)))
