"""What the torch pipeline runs and what it refuses, each refusal one line naming the field,
before anything starts (the capability table: trainspec/torch/capabilities.py). The torch
pipeline's steps: tests/torch/test_torch_pipeline.py; the JAX pipeline's: tests/jax/test_pipeline.py."""
from __future__ import annotations

import pytest

from trainspec.core.capabilities import Request
from trainspec.core.mesh import resolve_mesh
from trainspec.core.spec import load_spec
from trainspec.torch.capabilities import TORCH


def refusals(stages: int, *sets: str, tensor: int = 1) -> list[str]:
    s = load_spec(None, [f'mesh.axes={{data={{size=-1}},stage={{role="pipeline",size={stages}}},'
                         f'tensor={{size={tensor}}}}}', "model.n_layers=4", *sets])
    return TORCH.refusals(Request(s, resolve_mesh(s, 4)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_torch_runs_the_core_s_schedules_over_a_split_pipeline_axis(schedule):
    assert refusals(2, f'pipeline.schedule="{schedule}"', "pipeline.virtual_stages="
                    f"{2 if schedule == 'interleaved_1f1b' else 1}") == []


@pytest.mark.parametrize("sets, field", [
    (['pipeline.schedule="zero_bubble_v"'], "pipeline.schedule"),
    (["metrics.gns=true", "batch.micro_batch=8"], "metrics.gns"),
    (["semi_sync.inner_steps=4"], "semi_sync.inner_steps"),
], ids=["zero_bubble_v", "gns", "semi_sync"])
def test_torch_refuses_what_its_pipeline_does_not_run_by_name(sets, field):
    lines = refusals(2, *sets)
    assert len(lines) == 1 and lines[0].startswith(f"{field}: "), lines
    assert "\n" not in lines[0]


@pytest.mark.parametrize("sets, tensor", [([], 2), (["model.moe.experts=4"], 1)],
                         ids=["tensor", "experts"])
def test_torch_refuses_a_pipeline_beside_a_tensor_axis_or_experts(sets, tensor):
    lines = refusals(2, *sets, tensor=tensor)
    assert lines == ["mesh.axes.*.size: the torch pipeline composes with data and fsdp axes; "
                     "a split pipeline axis with a split tensor or context axis or [model.moe] "
                     "is not run"], lines


def test_one_stage_leaves_every_pipeline_field_without_effect():
    assert refusals(1, 'pipeline.schedule="zero_bubble_v"', "metrics.gns=true",
                    "batch.micro_batch=8") == []
