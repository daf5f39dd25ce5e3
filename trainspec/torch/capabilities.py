"""What the torch implementation does with every field of the spec and every flag of
`trainspec train` (the capability table, trainspec/core/capabilities.py; docs/adapters.md).
Framework-free, so that a spec is refused in one line before any rank starts."""
from __future__ import annotations

from trainspec.core.capabilities import (
    INIT_FROM_WITH_MODEL, Capabilities, Refusal, honoured, refused)
from trainspec.core.pipeline.schedule import GENERATED

REFERENCE_MODEL = "the reference transformer in torch (trainspec/torch/models/transformer.py)"
QUALIFIES_COMPRESSION = "of the compressed data all-reduce (no effect without a compression)"


def _one_split_axis(role: str) -> Refusal:
    return Refusal(f"when more than one {role} axis is split",
                   lambda value, r: len(r.split(role)) > 1,
                   f"the torch implementation splits at most one {role} axis, got {{axes}}",
                   lambda r: {"axes": ", ".join(f"{a}={r.sizes[a]}" for a in r.split(role))})


def _tensor_axis(r) -> tuple[str, int]:
    axes = r.split("tensor")
    return (axes[0], r.sizes[axes[0]]) if axes else ("", 1)


TENSOR_DIVIDES = Refusal(
    "when the tensor axis does not divide it", lambda value, r: value % _tensor_axis(r)[1] != 0,
    "{value} is not divisible by the {size} ranks of tensor axis '{axis}'",
    lambda r: dict(zip(("axis", "size"), _tensor_axis(r))))


NOTHING_TO_MEASURE_GNS = Refusal(
    "when true with one replica and one micro-batch",
    lambda value, r: value is True and not r.split("data") and r.spec.batch.accumulation_steps == 1,
    "true cannot be measured: one data-parallel replica and one micro-batch give no second "
    "batch size")


def _pipelined(when: str, test, reason: str) -> Refusal:
    """A refusal that applies where the pipeline axis is split."""
    return Refusal(f"{when}, with a split pipeline axis",
                   lambda value, r: bool(r.split("pipeline")) and test(value, r), reason)


PIPELINE_REFUSALS = (
    _pipelined("with a split tensor or context axis or experts",
               lambda value, r: bool(r.split("tensor") or r.split("context"))
               or r.spec.model.moe is not None,
               "the torch pipeline composes with data and fsdp axes; a split pipeline axis "
               "with a split tensor or context axis or [model.moe] is not run"),
)
PIPELINE = "trainspec/torch/pipeline.py"


def _semi_sync(when: str, test, reason: str) -> Refusal:
    return Refusal(when, lambda value, r: value is not None and test(r), reason)


SEMI_SYNC_REFUSALS = (
    _semi_sync("with fewer than 2 data groups", lambda r: len(r.split("data")) == 0,
               "needs at least 2 data-parallel groups (a split data axis); one group would be "
               "a single worker with an outer optimizer"),
    _semi_sync("with a compression", lambda r: r.spec.collectives.compression != "none",
               "the torch implementation exchanges the outer deltas uncompressed; set "
               "collectives.compression = \"none\""),
    _semi_sync("with shard_over_data", lambda r: r.spec.layout.optimizer_state == "shard_over_data",
               "each data group keeps its own optimizer state; set layout.optimizer_state = "
               "\"like_params\""),
    _semi_sync("with metrics.gns = true", lambda r: r.spec.metrics.gns is True,
               "metrics.gns = true cannot be measured: no gradient is reduced across groups"),
)


MOE_BESIDE = Refusal(
    "with semi_sync",
    lambda value, r: value is not None and r.spec.semi_sync is not None,
    "the torch implementation routes experts over the whole micro-batch, which [semi_sync]'s "
    "groups divide: leave [semi_sync] out")


TORCH = Capabilities("torch", dict([
    ("spec_version", honoured("validated by the core")),
    ("seed", honoured("seeds the initialisation (torch's generator: the same distributions "
                      "as JAX's, other numbers) and the data order (the core's ByteBatches)")),
    ("mesh.axes.*.role", honoured("data: gradients all-reduced over the data group; fsdp: "
                                  "FSDP2 fully_shard; tensor: DTensor column/row-wise plans; "
                                  "context: each rank its chunks of every sequence, attention "
                                  "across them (trainspec/torch/context.py); expert: each rank "
                                  "its rows and its experts (trainspec/torch/models/moe.py)")),
    ("mesh.axes.*.size", honoured("a DeviceMesh with the spec's names, sizes and row-major "
                                  "order, one rank per device",
                                  _one_split_axis("fsdp"), _one_split_axis("tensor"),
                                  _one_split_axis("context"),
                                  _one_split_axis("expert"),
                                  *PIPELINE_REFUSALS)),
    ("mesh.axes.*.dcn", honoured(
        "across hosts (LOCAL_WORLD_SIZE ranks each), the core's hybrid layout: a dcn-shaped grid "
        "of hosts, each host's ranks in the ici shape; on one host laid out within it")),
    ("mesh.exclude_devices", honoured(
        "ranks of the job as launched: they leave it, and the rest form a new job over the "
        "longest prefix of them the mesh and batch fit (trainspec.torch.members)")),
    ("layout.rules", refused(
        "unless empty", bool,
        "the torch implementation lays a model out by module names (FSDP2 units, a DTensor "
        "plan: trainspec.torch.wrap's fsdp_units and tensor_plan), not by logical axes, which "
        "torch modules do not carry; remove the rules")),
    ("layout.optimizer_state", honoured(
        "like_params: FSDP2 and DTensor lay the state out like its parameter; shard_over_data: "
        "ZeRO-1, each data replica steps its flat slice of every local block and all-gathers "
        "them (element-wise torch optimizers)")),
    ("precision.param", honoured("the parameters' storage dtype")),
    ("precision.compute", honoured("every matmul's operands cast to it")),
    ("precision.grad_reduce", honoured("the dtype of the gradient all-reduce (FSDP2 "
                                       "reduce_dtype)")),
    ("batch.global_batch", honoured("split over the data and fsdp axes, row-major")),
    ("batch.micro_batch", honoured("token-weighted accumulation: loss sums, divided once by "
                                   "the valid tokens of the whole batch")),
    ("batch.seq_len", honoured()),
    ("remat.policy", honoured(
        "torch's checkpoint of every block (the FSDP2 units); the dots policies as selective "
        "activation checkpointing that keeps matmul (and fused attention) outputs")),
    ("pipeline.microbatches", honoured(
        f"the reference model's stages over the pipeline axis ({PIPELINE}): "
        "torch.distributed.pipelining's PipelineStage and schedule runtime")),
    ("pipeline.schedule", honoured(
        "gpipe, 1f1b, interleaved_1f1b: the core's per-stage orders, run as they are by "
        "torch's schedule runtime",
        _pipelined("unless gpipe, 1f1b or interleaved_1f1b",
                   lambda value, r: value not in GENERATED,
                   "the torch implementation runs the schedules the core generates "
                   "(gpipe, 1f1b, interleaved_1f1b), not {value!r}"))),
    ("pipeline.virtual_stages", honoured(
        "model chunks per rank, looped placement, each a PipelineStage (and FSDP2 root) over "
        "a view of the rank's part")),
    ("pipeline.layers_per_stage", honoured("the core's split (an even one by default)")),
    ("collectives.backend", refused(
        "unless xla", lambda v: v != "xla",
        "{value!r} is a JAX backend; the torch implementation reduces through "
        "torch.distributed (leave the default)")),
    ("collectives.timeout_s", honoured("the process groups' timeout")),
    ("collectives.compression", honoured(
        "bf16 or int8 on the data axes: core.compression's two stages (all-to-all, all-gather) "
        "of core.packed buffers, in the JAX step's order for the reference model")),
    ("collectives.error_feedback", honoured(QUALIFIES_COMPRESSION)),
    ("collectives.compression_block", honoured(QUALIFIES_COMPRESSION)),
    ("metrics.sink", honoured("the core's JSONL writer, on rank 0")),
    ("metrics.path", honoured()),
    ("metrics.interval", honoured()),
    ("metrics.flops_convention", honoured()),
    ("metrics.peak_flops_per_device", honoured()),
    ("metrics.sinks", honoured("the core's sinks: the trainspec.sinks entry points, on rank 0")),
    ("metrics.tensorboard", honoured("the core's sinks (tensorboardX), on rank 0")),
    ("metrics.gns", honoured(
        "from replicas or micro-batches, as the JAX step (not with a split pipeline axis: "
        "the default is then off)", NOTHING_TO_MEASURE_GNS,
        _pipelined("when true", lambda value, r: value is True,
                   "true is not measured by the torch pipeline; leave it unset or false"))),
    ("model.vocab_size", honoured(REFERENCE_MODEL, TENSOR_DIVIDES)),
    ("model.d_model", honoured(REFERENCE_MODEL)),
    ("model.n_layers", honoured(REFERENCE_MODEL)),
    ("model.n_heads", honoured(REFERENCE_MODEL, TENSOR_DIVIDES)),
    ("model.d_ff", honoured(REFERENCE_MODEL, TENSOR_DIVIDES)),
    ("model.moe.experts", honoured(
        "every block's MLP (trainspec/torch/models/moe.py), routed over the whole micro-batch; "
        "experts split over the expert axis, rows moved by all-to-all", MOE_BESIDE)),
    *((f"model.moe.{name}", honoured("the core's routing rule, as JAX's"))
      for name in ("top_k", "capacity_factor", "load_balance_weight", "z_loss_weight")),
    ("context.attention", honoured(
        "ring: send/recv of key/value blocks around the context group with an online softmax; "
        "all_gather: one all-gather of them (trainspec/torch/context.py, autograd through both)")),
    ("context.split", honoured("each rank's tokens taken from its rows in the step, the "
                               "core's positions")),
    *((f"optimizer.{name}", honoured("torch.optim.AdamW or SGD, stepped as optax's"))
      for name in ("name", "learning_rate", "warmup_steps", "weight_decay", "grad_clip_norm")),
    ("train.steps", honoured()),
    ("eval.interval", honoured("loss_fn under torch.no_grad, the model in eval mode, summed "
                               "over the batch's ranks (under semi_sync: rank 0's group's); "
                               "with a pipeline, each stage's part in turn")),
    ("profile.start_step", honoured("torch.profiler around the steps, exported as a "
                                    "Chrome trace per traced rank")),
    ("profile.steps", honoured()),
    ("profile.process", honoured("the rank that traces")),
    ("eval.batches", honoured()),
    ("eval.source", honoured()),
    ("checkpoint.interval", honoured("safetensors blocks under the trunk's manifest, resharded on load")),
    ("checkpoint.keep", honoured()),
    ("checkpoint.dir", honoured()),
    ("checkpoint.async_save", honoured(
        "true: the state is copied to host memory before the step goes on, written in the "
        "background and sealed over a gloo group of its own once every rank's file is written; "
        "false: training waits for each save")),
    ("health.preflight", honoured(
        "every rank: a matmul in each float dtype against the float64 product, an all-reduce "
        "of known integers over the job and each split axis; failing ranks named and left out "
        "(trainspec.torch.preflight)")),
    ("health.nan.policy", honoured(
        "skip, halt: the core's state machine, per step; rollback: the core's run loop on the "
        "global loss and gradient norm, and on the state (each rank its blocks) before each "
        "checkpoint")),
    ("health.nan.max_consecutive_skips", honoured("the core's state machine, per step")),
    *((f"health.nan.{name}", honoured("the core's run loop")) for name in (
        "max_rollbacks", "skip_batches")),
    *((f"health.spikes.{name}", honoured("the core's rule on the host's loss"))
      for name in ("window", "k", "min_excess", "min_steps")),
    ("health.fingerprints.interval", honoured("every rank fingerprints its blocks; the core "
                                              "votes over the data group")),
    ("health.fingerprints.policy", honoured(
        "halt; rollback: the diverged ranks leave, the rest form a new job on the mesh that "
        "fits them and restore the last good checkpoint onto it")),
    *((f"health.stragglers.{name}", honoured("the core's rule over every rank's step times"))
      for name in ("window", "k", "min_excess")),
    ("semi_sync.inner_steps", honoured(
        "DiLoCo: each data group steps on its rows with no data-axis traffic, the outer step "
        "every H steps (trainspec/torch/semi_sync.py)", *SEMI_SYNC_REFUSALS,
        _pipelined("when set", lambda value, r: value is not None,
                   "the torch pipeline runs synchronous steps; remove [semi_sync]"))),
    *((f"semi_sync.{name}", honoured("the outer step: SGD with Nesterov momentum on the "
                                     "groups' mean delta"))
      for name in ("outer_optimizer", "outer_lr", "outer_momentum")),
    # the flags of `trainspec train`
    ("--spec", honoured()),
    ("--steps", honoured()),
    ("--run-dir", honoured()),
    ("--set", honoured()),
    ("--summary-json", honoured()),
    ("--quiet", honoured()),
    ("--framework", honoured("torch")),
    ("--nprocs", honoured("the ranks to start (default 4 on CPU, one per GPU)")),
    ("--host-devices", refused(
        "when given", lambda v: v is not None,
        "a JAX flag; torch runs one device per rank (set the ranks with --nprocs)")),
    ("--exclude-devices", honoured("added to mesh.exclude_devices")),
    ("--restart", honoured("the core's run loop: checkpoints set aside, from step 0")),
    ("--model", honoured("a user's model, loss and data through trainspec.torch.wrap")),
    ("--init-from", honoured("the file's parameters loaded into the full model on every rank "
                             "before it is sharded; a resume wins", INIT_FROM_WITH_MODEL)),
]))
