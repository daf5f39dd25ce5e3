"""The planner (trainspec.core.plan) against what XLA:CPU compiles here (docs/plan.md).

Every shipped example (examples/*.toml, on 8 devices, found by glob so that a new example is
checked too), and every layout the planner accepts for the validation model at 1-8 devices,
with 2 processes x 4 devices through the single-process dcn path (mesh.py lays a dcn factor out
within one process, so the compiled program, its memory and its collectives are those of the
2 x 4 job); each compiled once for its abstract state, nothing run, and held to the plan by
tests/jax/plan_vs_compiled.py. The grid over precision, remat, optimizer state and micro-batch is
tests/jax/test_plan_grid.py, a file of its own so that the two run on two workers. None of these
programs set the CPU profile's memory counts (plan.xla_cpu: read off another model's buffers).
"""
from pathlib import Path

import pytest

from plan_vs_compiled import check_against_compiled
from trainspec.core.spec import load_spec
from trainspec.jax.tools.plan_check import validation_layouts, validation_spec

pytestmark = pytest.mark.slow

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example(example):
    check_against_compiled(load_spec(example), 8, example.stem)


@pytest.mark.parametrize("layout", validation_layouts(), ids=lambda l: "d{}f{}t{}dcn{}".format(*l))
def test_every_layout_of_the_validation_model(layout):
    d, f, t, dcn = layout
    check_against_compiled(validation_spec(d, f, t, dcn), d * f * t, f"d={d} f={f} t={t} dcn={dcn}")
