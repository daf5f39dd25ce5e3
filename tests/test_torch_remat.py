"""remat.policy on torch in one process (a one-rank job): what each policy recomputes in the
backward pass, counted by operator, on nanoGPT's GPT through trainspec.torch.wrap (its blocks,
the default units, are checkpointed); the step's numbers are those without remat; a model
without blocks refuses a policy in one line. On 4 ranks under data, data x fsdp and data x
tensor: tests/test_torch_features.py."""
import collections

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import trainspec.torch
from gpt_model import GPT, GPTConfig, token_loss
from trainspec.core.conformance_runner import ragged_batch
from trainspec.core.data import ByteBatches
from trainspec.core.errors import UserInputError
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.torch.adapter import TorchAdapter

SETS = ["batch.seq_len=16", "batch.global_batch=4", "optimizer.warmup_steps=1"]
LAYERS = GPTConfig().n_layer
MATMUL, ATTENTION, GELU = "addmm", "_scaled_dot_product_flash_attention_for_cpu", "gelu"
# which of a block's forward operators the backward pass runs again, per policy
RECOMPUTED = {
    "none": set(),
    "full": {MATMUL, ATTENTION, GELU},
    "dots_saveable": {GELU},  # matmuls and the fused attention kept
    "dots_with_no_batch_dims_saveable": {ATTENTION, GELU},  # attention has batch dimensions
}


@pytest.fixture(scope="module", autouse=True)
def one_rank_job():
    adapter = TorchAdapter()
    adapter.join()  # no launcher in the environment: a job of one rank
    yield
    adapter.leave()


def spec(*overrides):
    return load_spec(DEFAULT_SPEC_PATH, [*SETS, *overrides])


class BackwardOps(TorchDispatchMode):
    """Counts the operators run once `loss_fn` has returned: the backward pass (and the
    optimizer's, which runs no matmul, attention or gelu)."""

    def __init__(self):
        super().__init__()
        self.backward, self.counts = False, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.backward:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def steps():
    """policy -> (metrics of one step, parameters after it, backward operator counts)."""
    s = spec()
    batch = ragged_batch(ByteBatches(s.batch.seq_len, s.batch.global_batch, s.seed), 0)
    out = {}
    for policy in RECOMPUTED:
        ops = BackwardOps()

        def loss_fn(model, b, ops=ops):
            result = token_loss(model, b)
            ops.backward = True
            return result

        step = trainspec.torch.wrap(lambda: GPT(GPTConfig()), loss_fn,
                                    spec(f"remat.policy={policy}"))
        with ops:
            metrics = step(batch)
        out[policy] = metrics, [p.detach().clone() for p in step.params], ops.counts
    return out


@pytest.mark.parametrize("policy", list(RECOMPUTED))
def test_each_policy_recomputes_what_it_names(steps, policy):
    counts = steps[policy][2]
    recomputed = {op for op in (MATMUL, ATTENTION, GELU) if counts[op]}
    assert recomputed == RECOMPUTED[policy], dict(counts)
    if ATTENTION in recomputed:  # once per block: every block is a unit
        assert counts[ATTENTION] == LAYERS


@pytest.mark.parametrize("policy", [p for p in RECOMPUTED if p != "none"])
def test_remat_changes_no_number(steps, policy):
    metrics, params, _ = steps[policy]
    want_metrics, want_params, _ = steps["none"]
    assert (metrics["loss"], metrics["grad_norm"]) == (want_metrics["loss"],
                                                       want_metrics["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))


def test_a_model_without_blocks_refuses_a_policy_in_one_line():
    def loss_fn(model, b):
        logits = model(torch.as_tensor(np.asarray(b["inputs"])).float())
        return logits.sum(), torch.tensor(1.0)

    with pytest.raises(UserInputError) as error:
        trainspec.torch.wrap(lambda: nn.Sequential(nn.Linear(16, 16)), loss_fn,
                             spec("remat.policy=full"))
    assert str(error.value).startswith("remat.policy: 'full' checkpoints each repeated block, "
                                       "and the model has no nn.ModuleList")
    assert "\n" not in str(error.value)
