"""Implementations that do not run pipeline stages say so in one line, before anything starts,
and leave a one-stage spec alone (the capability table: trainspec/core/capabilities.py)."""
from __future__ import annotations

import pytest

from trainspec.core.capabilities import Request
from trainspec.core.mesh import resolve_mesh
from trainspec.core.spec import load_spec
from trainspec.jax.capabilities import JAX
from trainspec.torch.capabilities import TORCH


def spec(stages: int):
    return load_spec('mesh.axes = {data = {size = -1}, stage = {role = "pipeline", size = %d}}\n'
                     "[model]\nn_layers = 2\n" % stages)


@pytest.mark.parametrize("table", [JAX, TORCH], ids=lambda t: t.implementation)
def test_implementations_without_pipeline_execution_refuse_a_split_pipeline_axis(table):
    s = spec(2)
    lines = table.refusals(Request(s, resolve_mesh(s, 4)))
    assert any(line.startswith("mesh.axes.*.size: the ") and "pipeline axes, got stage=2" in line
               for line in lines), lines
    one_stage = spec(1)
    assert not table.refusals(Request(one_stage, resolve_mesh(one_stage, 4)))
