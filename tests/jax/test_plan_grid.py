"""The planner's memory and communication against XLA:CPU's compiled step on a grid over
precision x remat policy x optimizer-state layout x micro-batch, on the mixed example's data x
fsdp x tensor layout and model, held to the plan by tests/jax/plan_vs_compiled.py (docs/plan.md;
tests/jax/test_plan_compiled.py: the examples and the validation layouts). The remat policy
dots_with_no_batch_dims_saveable is left out: on XLA:CPU it keeps what dots_saveable keeps of
this model, and all-reduces and gathers the same.
"""
import itertools
from pathlib import Path

import pytest

from plan_vs_compiled import check_against_compiled
from trainspec.core.spec import load_spec

pytestmark = pytest.mark.slow

MIXED = Path(__file__).parents[2] / "examples" / "mixed.toml"
PRECISIONS = {
    "f32": ["precision.param=float32", "precision.compute=float32",
            "precision.grad_reduce=float32"],
    "bf16compute": ["precision.param=float32", "precision.compute=bfloat16",
                    "precision.grad_reduce=float32"],
    "bf16": ["precision.param=bfloat16", "precision.compute=bfloat16",
             "precision.grad_reduce=bfloat16"],
}
REMAT = ("none", "full", "dots_saveable")
OPTIMIZER_STATE = ("like_params", "shard_over_data")
MICRO_BATCHES = (8, 32)  # of the global 32: 4 micro-batches a step, and 1
GRID = list(itertools.product(PRECISIONS, REMAT, OPTIMIZER_STATE, MICRO_BATCHES))


@pytest.mark.parametrize("precision, remat, optimizer_state, micro", GRID,
                         ids=lambda v: str(v))
def test_grid_on_the_mixed_layout(precision, remat, optimizer_state, micro):
    spec = load_spec(MIXED, [*PRECISIONS[precision], f"remat.policy={remat}",
                             f"layout.optimizer_state={optimizer_state}",
                             f"batch.micro_batch={micro}"])
    check_against_compiled(spec, 8, f"mixed {precision} {remat} {optimizer_state} micro={micro}")
