"""trainspec.torch.wrap in one process (a one-rank job): what it refuses, in one line naming the
argument or field; which modules its default rules pick (FSDP2 units, the tensor-parallel plan);
the non-finite policy; autocast; what each remat.policy recomputes, counted by operator in the
backward pass, and that it changes no number; the noise scale over micro-batches; checkpoints
refused by a model of other shapes or another compression. Multi-rank behaviour (layouts
against plain torch, resume on another mesh, replica check) is in test_torch_wrap.py; remat,
ZeRO-1, compression and GNS against references in test_torch_features.py."""
import collections
import logging
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import trainspec.torch
from trainspec.cli.main import main
from gpt_model import GPT, GPTConfig, adamw, token_loss
from tiny import TINY
from trainspec.core.conformance_runner import ragged_batch
from trainspec.core.data import ByteBatches
from trainspec.core.errors import UserInputError
from trainspec.core.health import HealthHalt
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.layout import default_tensor_plan, shard_units
from trainspec.torch.models.transformer import Transformer

SETS = ["batch.seq_len=16", "batch.global_batch=4", "optimizer.warmup_steps=1"]

MATMUL, ATTENTION, GELU = "addmm", "_scaled_dot_product_flash_attention_for_cpu", "gelu"
# which of a block's forward operators the backward pass runs again, per remat.policy
RECOMPUTED = {
    "none": set(),
    "full": {MATMUL, ATTENTION, GELU},
    "dots_saveable": {GELU},  # matmuls and the fused attention kept
    "dots_with_no_batch_dims_saveable": {ATTENTION, GELU},  # attention has batch dimensions
}


@pytest.fixture(scope="module", autouse=True)
def one_rank_job():
    adapter = TorchRuntime()
    adapter.join()  # no launcher in the environment: a job of one rank
    yield
    adapter.leave()


def spec(*overrides):
    return load_spec(DEFAULT_SPEC_PATH, [*SETS, *overrides])


def gpt(**config):
    return lambda: GPT(GPTConfig(**config))


def batch(step=0, s=None):
    s = s or spec()
    return ragged_batch(ByteBatches(s.batch.seq_len, s.batch.global_batch, s.seed), step)


def wrap(model_fn=gpt(), loss_fn=token_loss, overrides=(), **options):
    return trainspec.torch.wrap(model_fn, loss_fn, spec(*overrides), **options)


def _refusal(call) -> str:
    with pytest.raises(UserInputError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("call,starts", [
    (lambda: wrap(lambda: "a model"), "model_fn: returned a str, not a torch.nn.Module"),
    (lambda: wrap(optimizer_fn=lambda params: adamw(nn.Linear(2, 2).parameters())),
     "optimizer_fn: 28 trainable parameters are not in its optimizer "
     "(first: transformer.wte.weight)"),
    (lambda: wrap(optimizer_fn=lambda params: "adamw"), "optimizer_fn: returned a str"),
    (lambda: wrap(fsdp_units=["transformer.blocks.*"]),
     "fsdp_units: 'transformer.blocks.*' names no module of the model"),
    (lambda: wrap(tensor_plan={"transformer.h.*.attn.qkv": None}),
     "tensor_plan: 'transformer.h.*.attn.qkv' names no module of the model"),
    (lambda: wrap(overrides=["precision.param=bfloat16"]),
     "precision.compute: float32 is wider than precision.param bfloat16"),
    (lambda: wrap(overrides=["layout.rules.embed=[]"]), "layout.rules:"),
    (lambda: wrap(overrides=["layout.optimizer_state=shard_over_data"],
                  optimizer_fn=lambda params: torch.optim.Adafactor(params)),
     "layout.optimizer_state: shard_over_data updates each data replica's slice of every "
     "parameter, which only an element-wise optimizer allows"),
    (lambda: wrap(lambda: nn.Sequential(nn.Linear(16, 16)), overrides=["remat.policy=full"]),
     "remat.policy: 'full' checkpoints each repeated block, and the model has no nn.ModuleList"),
    (lambda: wrap(overrides=["metrics.gns=true"]), "metrics.gns: true cannot be measured: one "
     "data-parallel replica and one micro-batch give no second batch size"),
    (lambda: wrap(mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("data",))),
     "mesh: its axes {'data': 1} are not the spec's mesh.axes {'data': 1, 'fsdp': 1, 'tensor': 1}"),
])
def test_bad_arguments_are_refused_in_one_line(call, starts):
    assert _refusal(call).startswith(starts)


@pytest.mark.parametrize("bad_batch,starts", [
    (lambda b: {k: v[:3] for k, v in b.items()}, "batch['inputs'] has 3 rows; expected "
     "batch.global_batch = 4 (the global batch) or 4 (this rank's rows, step.rows())"),
    (lambda b: list(b.values()), "batch: expected a dict of arrays, got a list"),
])
def test_a_bad_batch_is_refused_in_one_line(bad_batch, starts):
    step = wrap()
    assert _refusal(lambda: step(bad_batch(batch()))).startswith(starts)


@pytest.mark.parametrize("loss_fn,got", [
    (lambda model, b: token_loss(model, b)[0] / token_loss(model, b)[1],
     "got a tensor of shape ()"),
    (lambda model, b: (*token_loss(model, b), {}), "got a tuple of 3"),
    (lambda model, b: (torch.tensor(1.0), torch.tensor(2.0)),
     "got a tuple of 2: (a tensor of shape (), no grad, a tensor of shape (), no grad)"),
])
def test_a_loss_fn_of_another_form_is_refused(loss_fn, got):
    step = wrap(loss_fn=loss_fn)
    message = _refusal(lambda: step(batch()))
    assert message.startswith("loss_fn: expected (loss_sum, valid_tokens)") and got in message


def test_default_fsdp_units_are_the_outermost_module_lists_children():
    assert shard_units(GPT(GPTConfig()), None) == ["transformer.h.0", "transformer.h.1"]
    # rules: one fnmatch pattern per level; nested units come first (fully_shard wants them so)
    assert shard_units(GPT(GPTConfig()), ["transformer.h.*", "transformer.h.1.mlp"]) == [
        "transformer.h.1.mlp", "transformer.h.0", "transformer.h.1"]
    assert shard_units(Transformer(load_spec(DEFAULT_SPEC_PATH, TINY).model), ["blocks.*"]) == [
        "blocks.block_0"]


def test_default_tensor_plan_pairs_linears_by_name():
    reference = Transformer(load_spec(DEFAULT_SPEC_PATH, [*TINY, "model.n_layers=2"]).model)
    plan = default_tensor_plan(reference, 2)
    kinds = {name: type(style).__name__ for name, style in plan.items()}
    block = {"query": "Colwise", "key": "Colwise", "value": "Colwise", "out": "Rowwise",
             "mlp_in": "Colwise", "mlp_out": "Rowwise"}
    want = {f"blocks.block_{i}.{leaf}": f"{kind}Parallel" for i in range(2)
            for leaf, kind in block.items()}
    assert kinds == {**want, "head": "ColwiseParallel"}
    assert plan["head"].output_layouts[0].is_replicate()  # the logits are gathered whole


class Unpaired(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.mlp_out = nn.Linear(8, 8), nn.Linear(16, 8)  # 8 wide into 16


@pytest.mark.parametrize("model,ranks,starts", [
    (GPT(GPTConfig()), 2, "tensor_plan: lm_head.weight is shared with transformer.wte (tied)"),
    (GPT(GPTConfig(bias=False)).transformer.h[0].mlp, 2,
     "tensor_plan: the model has no nn.Linear that the default plan knows by name"),
    (Unpaired(), 2, "tensor_plan: the default plan splits query but finds no row-split nn.Linear"),
    (Transformer(load_spec(DEFAULT_SPEC_PATH, TINY).model), 3,
     "tensor_plan: blocks.block_0.query has width 32, not divisible by the 3 ranks"),
])
def test_default_tensor_plan_refuses_what_it_cannot_split(model, ranks, starts):
    assert _refusal(lambda: default_tensor_plan(model, ranks)).startswith(starts)


def _poisoned(b):
    return {**b, "mask": np.full_like(b["mask"], np.nan)}


def test_nonfinite_steps_are_skipped_then_halt():
    step = wrap(overrides=["health.nan.policy=skip", "health.nan.max_consecutive_skips=1"])
    first = step(batch(0))
    before = {k: v.detach().clone() for k, v in step.model.state_dict().items()}
    optimizer_before = repr(step.optimizer.state_dict())
    skipped = step(_poisoned(batch(1)))
    assert (skipped["nonfinite"], skipped["skipped_steps"], skipped["valid_tokens"]) == (1, 1, 0.0)
    assert first["nonfinite"] == 0 and step.updates == 1
    after = step.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert repr(step.optimizer.state_dict()) == optimizer_before
    with pytest.raises(HealthHalt, match="non-finite loss, gradients or state at step 3"):
        step(_poisoned(batch(2)))
    assert all(torch.equal(before[k], after[k]) for k in before)  # the last good state


def test_halt_policy_stops_at_the_first_nonfinite_step():
    step = wrap(overrides=["health.nan.policy=halt"])
    with pytest.raises(HealthHalt, match="at step 1 .health.nan.policy = halt"):
        step(_poisoned(batch(0)))


def test_sixteen_bit_compute_is_autocast():
    seen = []

    def loss_fn(model, b):
        loss_sum, tokens = token_loss(model, b)
        seen.append(model.lm_head(torch.zeros(1, 32)).dtype)
        return loss_sum, tokens

    step = wrap(loss_fn=loss_fn, overrides=["precision.compute=bfloat16"])
    losses = [step(batch(i))["loss"] for i in range(4)]
    assert seen == [torch.bfloat16] * 4  # matmuls in the compute dtype ...
    assert {p.dtype for p in step.params} == {torch.float32}  # ... parameters stored in param
    assert losses[-1] < losses[0]


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
def remat_steps():
    """policy -> (metrics of one step, parameters after it, backward operator counts)."""
    out = {}
    for policy in RECOMPUTED:
        ops = BackwardOps()

        def loss_fn(model, b, ops=ops):
            result = token_loss(model, b)
            ops.backward = True
            return result

        step = wrap(loss_fn=loss_fn, overrides=[f"remat.policy={policy}"])
        with ops:
            metrics = step(batch())
        out[policy] = metrics, [p.detach().clone() for p in step.params], ops.counts
    return out


@pytest.mark.parametrize("policy", list(RECOMPUTED))
def test_each_policy_recomputes_what_it_names(remat_steps, policy):
    counts = remat_steps[policy][2]
    recomputed = {op for op in (MATMUL, ATTENTION, GELU) if counts[op]}
    assert recomputed == RECOMPUTED[policy], dict(counts)
    if ATTENTION in recomputed:  # once per block: every block is a unit
        assert counts[ATTENTION] == GPTConfig().n_layer


@pytest.mark.parametrize("policy", [p for p in RECOMPUTED if p != "none"])
def test_remat_changes_no_number(remat_steps, policy):
    metrics, params, _ = remat_steps[policy]
    want_metrics, want_params, _ = remat_steps["none"]
    assert (metrics["loss"], metrics["grad_norm"]) == (want_metrics["loss"],
                                                       want_metrics["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))


def test_micro_batches_measure_the_noise_scale_on_one_rank():
    step = wrap(overrides=["batch.micro_batch=2"])
    assert (step.gns_source, step.gns_note) == ("micro_batches", None)
    metrics = step(batch())
    assert np.isfinite(metrics["gns_grad_sq"]) and metrics["gns_trace"] > 0
    off = wrap(overrides=["batch.micro_batch=2", "metrics.gns=false"])
    assert off.gns_note == "metrics.gns = false" and "gns_trace" not in off(batch())


def test_a_resume_under_another_compression_is_refused(tmp_path):
    """What the state holds depends on it (an error-feedback residual), as on JAX."""
    step = wrap()
    step(batch())
    saved = trainspec.torch.TorchCheckpointer(step.spec, tmp_path)
    step.save(saved, 1)
    saved.wait()  # checkpoint.async_save: written in the background
    other = wrap(overrides=['collectives.compression="int8"'])
    checkpoints = trainspec.torch.TorchCheckpointer(other.spec, tmp_path)
    assert _refusal(lambda: other.restore(checkpoints)) == (
        f"collectives.compression: the checkpoints in {tmp_path}/checkpoints were written "
        "with 'none', the spec says 'int8'; use a new --run-dir, or the saved value")


def test_a_checkpoint_is_refused_by_a_model_of_other_shapes(tmp_path):
    step = wrap()
    step(batch())
    saved = trainspec.torch.TorchCheckpointer(step.spec, tmp_path)
    step.save(saved, 1)
    saved.wait()  # checkpoint.async_save: written in the background
    wider = wrap(gpt(n_embd=48))
    checkpoints = trainspec.torch.TorchCheckpointer(wider.spec, tmp_path)
    message = _refusal(lambda: wider.restore(checkpoints))
    assert message.startswith("model: parameter transformer.h.0.attn.c_attn.bias is [144] here "
                              f"and [96] in the checkpoint in {tmp_path}/checkpoints/1")
    same = wrap()
    assert same.restore(trainspec.torch.TorchCheckpointer(same.spec, tmp_path)) == 1
    assert same.updates == 1
    assert all(torch.equal(a, b) for a, b in zip(same.params, step.params))


@pytest.mark.parametrize("spec_schedule,lr", [(True, 0.0), (False, 0.5)])
def test_a_model_s_own_optimizer_keeps_its_learning_rate_without_spec_schedule(spec_schedule, lr):
    """By default the spec's schedule sets the learning rate (0 at the first update under
    warm-up) and clips; with spec_schedule=False (`--model` bringing its optimizer) the
    optimizer's own rate governs and nothing is clipped."""
    step = wrap(optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.5),
                overrides=["optimizer.grad_clip_norm=1e-6"], spec_schedule=spec_schedule)
    before = [q.detach().clone() for q in step.params]
    metrics = step(batch())
    moved = max(float((q.detach() - b).abs().max()) for q, b in zip(step.params, before))
    assert metrics["learning_rate"] == lr and step.learning_rate(1) == (0.5 if lr else 3e-3)
    # unclipped SGD at 0.5 moves a parameter far more than 0.5 x 1e-6
    assert (moved == 0.0) if spec_schedule else (moved > 1e-3)


class NanoGPTNamed(nn.Module):
    """A block named as modded-nanoGPT names its projections (none the default plan knows)
    beside an untied head the plan does know."""

    def __init__(self):
        super().__init__()
        block = nn.ModuleDict({name: nn.Linear(8, 8) for name in ("c_q", "c_k", "c_v")})
        block.update({"c_fc": nn.Linear(8, 32), "c_proj": nn.Linear(32, 8)})
        self.blocks = nn.ModuleList([block])
        self.lm_head = nn.Linear(8, 16)


def test_a_default_plan_that_leaves_block_linears_unsplit_warns_naming_them(caplog):
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        plan = default_tensor_plan(NanoGPTNamed(), 2)
    assert list(plan) == ["lm_head"]
    assert [r.getMessage() for r in caplog.records] == [(
        "tensor_plan: the default plan leaves 5 nn.Linear layers unsplit, each whole on every "
        "rank of the tensor axis (blocks.0.c_q, blocks.0.c_k, blocks.0.c_v, blocks.0.c_fc and "
        "1 more); give wrap (or a UserModel) a tensor_plan that names them")]


NANO = '''
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from trainspec.core.user_model import UserModel

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"c_fc": nn.Linear(8, 32),
                                                    "c_proj": nn.Linear(32, 8)})])
        self.lm_head = nn.Linear(8, 16)

def make(spec, plan=True):
    tensor_plan = {"blocks.0.c_fc": ColwiseParallel(), "blocks.0.c_proj": RowwiseParallel(),
                   "lm_head": ColwiseParallel()} if plan else None
    return UserModel(Net, None, None, tensor_plan=tensor_plan)

def unplanned(spec):
    return make(spec, plan=False)
'''


@pytest.mark.parametrize("fn,fc,warns", [("make", "dim 0 over tensor", False),
                                         ("unplanned", "replicated", True)])
def test_a_user_model_carries_its_tensor_plan(tmp_path, capsys, fn, fc, warns):
    """`validate --model` lays a UserModel out by its tensor_plan (the one `train --model`
    passes to wrap); without one, the nanoGPT-named block stays whole, and says so."""
    (tmp_path / "nano.py").write_text(NANO)
    assert main(["validate", str(DEFAULT_SPEC_PATH), "--framework", "torch", "--nprocs", "2",
                 "--model", f"{tmp_path / 'nano.py'}:{fn}", "--set", "mesh.axes.data.size=1",
                 "--set", "mesh.axes.tensor.size=2"]) == 0
    out, err = capsys.readouterr()
    assert re.search(rf"blocks\.0\.c_fc\.weight +\(32, 8\) +{fc}", out), out
    assert ("the default plan leaves 2 nn.Linear layers unsplit" in err) == warns, err


def test_a_profiled_step_writes_a_chrome_trace(tmp_path):
    """[profile] on torch: the step's operators between start_trace and stop_trace, exported
    as rank 0's Chrome trace (what the run loop does around profile.start_step)."""
    import json

    from trainspec.torch.engine import TorchEngine

    run_step = TorchEngine(wrap(), TorchRuntime())
    run_step.start_trace(tmp_path)
    run_step.job(batch())
    run_step.stop_trace()
    events = json.loads((tmp_path / "rank0.trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::addmm" for e in events)  # the model's matmuls
