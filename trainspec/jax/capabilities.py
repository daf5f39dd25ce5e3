"""What the JAX implementation does with every field of the spec and every flag of
`trainspec train` (the capability table, trainspec/core/capabilities.py; docs/adapters.md).
The reference implementation: it honours every field and refuses only combinations it cannot
run. Every field is listed by name, so that a new one is declared, not assumed. Framework-free,
like every table."""
from __future__ import annotations

from trainspec.core.pipeline.schedule import GENERATED
from trainspec.core.capabilities import (
    INIT_FROM_WITH_MODEL, Capabilities, Refusal, honoured, refused)
from trainspec.jax.backends import backend

def _beside_ext(r) -> tuple[str, ...]:
    """The split axes whose collectives XLA makes, not the ext backend: all but the data axes
    (the step's gradient sum), the context axes (the ring's permutes or the all-gather), the
    expert axes (the dispatch and combine all-to-alls) and the pipeline axes (the stages'
    permutes and sums, trainspec.jax.pipeline)."""
    ours = {*r.split("data"), *r.split("context"), *r.split("expert"), *r.split("pipeline")}
    return tuple(a for a in r.dims.split_beside("data") if a not in ours)


EXT_BESIDE_XLA = Refusal(
    "ext, when an fsdp or tensor axis is split",
    lambda name, r: not backend(name).beside_xla and bool(_beside_ext(r)),
    "ext needs every mesh axis but the data, context, expert and pipeline axes to be 1, got "
    "{axes}: "
    "its blocking custom calls can deadlock beside XLA's all-gathers and reduce-scatters on "
    "CPU; use backend = \"xla\"",
    lambda r: {"axes": ", ".join(f"{a}={r.sizes[a]}" for a in _beside_ext(r))})
COMPRESSION_ON_HIERARCHICAL = Refusal(
    "unless none, with the hierarchical backend",
    lambda compression, r: (compression != "none"
                            and not backend(r.spec.collectives.backend).compression_kernels),
    "{value} needs collectives.backend = \"xla\" or \"ext\" (the hierarchical backend "
    "reduces float32)")


# The step reduces over data replicas explicitly (trainspec.jax.replica_steps) with
# accumulation, GNS over replicas, a compression or a custom-call backend: the model then sees
# one replica's rows, and would route (and bound capacity) per replica, not over the
# micro-batch.
MOE_ROUTES_PER_REPLICA = Refusal(
    "with split data axes and accumulation, replica GNS, compression or a non-xla backend",
    lambda value, r: value is not None and bool(r.split("data")) and (
        r.spec.batch.accumulation_steps > 1 or r.spec.metrics.gns is not False
        or r.spec.collectives.compression != "none" or r.spec.collectives.backend != "xla"),
    "experts route over the whole micro-batch, which a split data axis with accumulation, "
    "metrics.gns, compression or a non-xla backend divides into replicas: set "
    "metrics.gns = false and leave those at their defaults, or split the batch over an "
    "expert or fsdp axis instead")


def _pipelined(when: str, test, reason: str) -> Refusal:
    """A refusal that applies where the pipeline axis is split."""
    return Refusal(f"{when}, with a split pipeline axis",
                   lambda value, r: bool(r.split("pipeline")) and test(value, r), reason)


# The pipelined loss is a shard_map over the pipeline axis, which does not run inside the
# per-replica vmap that reduces gradients through a custom-call backend
# (trainspec.jax.replica_steps).
PIPELINE_THROUGH_XLA = _pipelined(
    "hierarchical", lambda name, r: backend(name).beside_xla and not backend(name).native,
    "{value} reduces per-replica gradients, which a pipelined loss does not give: use "
    "backend = \"xla\" with a split pipeline axis")


def _reference(*fields: str) -> list:
    return [(f, honoured()) for f in fields]


JAX = Capabilities("jax", dict([
    *_reference("spec_version", "seed", "mesh.axes.*.role"),
    ("mesh.axes.*.size", honoured("jax.sharding.Mesh over the devices, row-major", _pipelined(
        "with a split context axis or experts",
        lambda value, r: bool(r.split("context")) or r.spec.model.moe is not None,
        "the JAX pipeline runs dense blocks attending over whole sequences: a split pipeline "
        "axis with a split context axis or [model.moe] is not run"))),
    ("mesh.axes.*.dcn", honoured("process blocks of the hybrid mesh (trainspec.core.mesh); "
                                 "with the hierarchical backend a data axis lies all within or "
                                 "all across processes")),
    ("mesh.exclude_devices", honoured("the mesh shrinks to the largest that fits the rest")),
    ("layout.rules", honoured("flax logical axis rules over the role defaults")),
    *_reference("layout.optimizer_state", "precision.param", "precision.compute",
                "precision.grad_reduce", "batch.global_batch"),
    ("batch.micro_batch", honoured("with loss_step: token-weighted accumulation")),
    *_reference("batch.seq_len"),
    ("remat.policy", honoured("jax.checkpoint policies per block")),
    ("pipeline.microbatches", honoured("a model's blocks (the reference model's, or those a "
                                       "user names in trainspec.jax.Stages) as a pipeline over "
                                       "the pipeline axis inside the step")),
    ("pipeline.schedule", honoured("gpipe, 1f1b, interleaved_1f1b: the core's slots run in "
                                   "order (trainspec.jax.pipeline)", _pipelined(
        "zero_bubble_v", lambda schedule, r: schedule not in GENERATED,
        "the JAX implementation runs the schedules the core generates "
        f"({', '.join(GENERATED)}), not {{value!r}}"))),
    ("pipeline.virtual_stages", honoured("model chunks per stage, looped placement")),
    ("pipeline.layers_per_stage", honoured("equal stages", _pipelined(
        "when the stages differ", lambda counts, r: len(set(counts)) > 1,
        "the JAX implementation stacks each stage's blocks and needs equal stages, got {value}"))),
    ("collectives.backend", honoured("xla, ext (the xla_ext custom calls; on GPUs through "
                                     "NCCL, compiled and not yet run on a GPU) or hierarchical",
                                     EXT_BESIDE_XLA, PIPELINE_THROUGH_XLA)),
    ("collectives.timeout_s", honoured(
        "the ext custom calls' wait, and XLA:CPU's collectives across processes (gloo) in a "
        "job trainspec joins (trainspec.jax.runtime); on GPU the ext CUDA handlers' wait "
        "(the NCCL communicator aborted; not yet run on a GPU) and, for XLA's collectives, "
        "NCCL's own")),
    ("collectives.compression", honoured("bf16 or int8 on the data axes, with loss_step",
                                         COMPRESSION_ON_HIERARCHICAL, Refusal(
        "unless none, with a split pipeline axis",
        lambda compression, r: compression != "none" and bool(r.split("pipeline")),
        "{value} needs the pipeline axis to be 1: the pipelined loss's gradients are reduced "
        "by XLA (trainspec.jax.pipeline)"))),
    *_reference("collectives.error_feedback", "collectives.compression_block", "metrics.sink",
                "metrics.path", "metrics.interval", "metrics.flops_convention",
                "metrics.peak_flops_per_device"),
    ("metrics.sinks", honoured("the core's sinks: the trainspec.sinks entry points, on process 0")),
    ("metrics.tensorboard", honoured("the core's sinks (tensorboardX), on process 0")),
    ("metrics.gns", honoured("from replicas or micro-batches; true where neither exists fails "
                             "naming the field")),
    *_reference("model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads",
                "model.d_ff"),
    ("model.moe.experts", honoured(
        "every block's MLP (trainspec.jax.models.moe); experts split over the expert axes, "
        "tokens moved by the dispatch and combine all-to-alls of collectives.backend",
        MOE_ROUTES_PER_REPLICA)),
    *_reference("model.moe.top_k", "model.moe.capacity_factor",
                "model.moe.load_balance_weight", "model.moe.z_loss_weight"),
    ("context.attention", honoured("ring: a permute of key/value blocks with an online "
                                   "softmax; all_gather: one all-gather (trainspec.jax.context); "
                                   "through collectives.backend")),
    ("context.split", honoured("the batch's sequences permuted in the step, each rank's "
                               "shard its chunks")),
    *_reference("optimizer.name", "optimizer.learning_rate",
                "optimizer.warmup_steps", "optimizer.weight_decay", "optimizer.grad_clip_norm",
                "train.steps", "checkpoint.interval", "checkpoint.keep"),
    ("checkpoint.async_save", honoured("true: orbax writes the state in the background, then "
                                       "process 0 seals it (manifest, rename) from a thread of "
                                       "its own; false: training waits for each save")),
    ("eval.interval", honoured("loss_fn's forward pass, jitted, on the step's batch sharding "
                               "(a loss_step; a semi_sync step refuses it by name)")),
    *_reference("eval.batches", "eval.source"),
    ("profile.start_step", honoured("jax.profiler.start_trace/stop_trace around the steps: "
                                    "TensorBoard's profile plugin and a Perfetto trace")),
    *_reference("profile.steps", "profile.process"),
    *_reference("checkpoint.dir"),
    ("health.preflight", honoured("trainspec doctor's checks; failing devices excluded")),
    ("health.nan.policy", honoured(
        "rollback: the core's run loop on the loss and gradient norm, a few steps late, and on "
        "the state (each device its slices) before each checkpoint; skip and halt: decided "
        "inside the step")),
    *_reference("health.nan.max_consecutive_skips"),
    *((f"health.nan.{name}", honoured("the core's run loop")) for name in (
        "max_rollbacks", "skip_batches")),
    *((f"health.spikes.{name}", honoured("the core's rule on the loss read a few steps late"))
      for name in ("window", "k", "min_excess", "min_steps")),
    *_reference("health.fingerprints.interval"),
    ("health.fingerprints.policy", honoured("halt, or rollback on the remaining devices")),
    *_reference("health.stragglers.window", "health.stragglers.k",
                "health.stragglers.min_excess"),
    ("semi_sync.inner_steps", honoured("DiLoCo, through trainspec.jax.wrap", _pipelined(
        "when present", lambda steps, r: steps is not None,
        "semi_sync runs each group's step under a vmap, in which the pipeline's shard_map does "
        "not run: set the pipeline axis to 1"))),
    *((f"semi_sync.{name}", honoured("DiLoCo, through trainspec.jax.wrap"))
      for name in ("outer_optimizer", "outer_lr", "outer_momentum")),
    # the flags of `trainspec train`
    *_reference("--spec", "--steps", "--run-dir", "--set", "--summary-json", "--host-devices",
                "--exclude-devices", "--restart", "--quiet", "--framework"),
    ("--model", honoured("a user's model, loss and data through wrap(loss_step(...))",
                         Refusal("with a split pipeline axis",
                                 lambda value, r: bool(value) and bool(r.split("pipeline")),
                                 "trainspec train pipelines the reference model only; set "
                                 "the pipeline axis to 1, or run your model's stages with "
                                 "trainspec.jax.pipelined in your own loop (docs/wrapping.md)"))),
    ("--init-from", honoured("the file's parameters placed straight into the step's shardings "
                             "(each process its own shards); a resume wins",
                             INIT_FROM_WITH_MODEL)),
    ("--nprocs", refused("when given", lambda v: v is not None,
                         "only with --framework torch (JAX jobs start their processes with "
                         "`trainspec launch`)")),
]))
