"""Memory, communication, step time and MFU of a decoder at published scale (a DecoderShape)
under data, fsdp, tensor, pipeline, context and expert parallelism, and the ranking of such
layouts (docs/plan.md, "Published architectures").

Where each thing lives, per device:
- parameters outside the experts: split by fsdp x tensor x pipeline, replicated over data,
  expert and context (their gradients summed over those);
- the routed experts' parameters: split by fsdp x tensor x pipeline x expert;
- gradients like their parameters; optimizer state like them; ZeRO (Rajbhandari et al. 2020)
  splits the optimizer state (stage 1) and the gradients too (stage 2) over the parameter's
  replicas;
- activations: each micro-batch's tokens split by context (the ring), all of them by tensor
  (sequence parallelism, Korthikanti et al. 2023), the layers by pipeline; the first stage
  holds the micro-batches its executed schedule keeps in flight at its peak
  (trainspec.core.pipeline.schedule: 1F1B min(pipeline, micro-batches), interleaved more).
Communication per device and step, in bytes sent (S of nccl-tests):
- tensor (sequence parallelism): per layer and micro-batch an all-gather before and a
  reduce-scatter after attention and after the MLP, in the forward pass and again in the
  backward (8 collectives of the micro-batch's activation, d_model wide), 12 with full remat
  (the forward again);
- pipeline: per micro-batch and chunk boundary the activation forward and its gradient back
  (2 v permutes of a stage), each tensor rank its own sequence shard;
- context: the ring passes each rank's key/value block on (context - 1) times per layer and
  micro-batch in the forward pass, and the blocks' gradients back in the backward pass (the
  autodiff of a permute): 2 (context - 1) x the local key/value bytes, 3 with full remat (the
  forward ring again);
- expert: per MoE layer and micro-batch, dispatch and combine in the forward pass and both again
  in the backward pass: 4 all-to-alls of the local tokens x rows per token x d_model x bytes,
  rows per token top_k for a slot-packed dispatch, `experts` for the reference model's
  buffers indexed by token (trainspec.jax.models.moe).
- data: one all-reduce of each gradient over its replicas; under ZeRO a reduce-scatter of the
  gradients and an all-gather of the updated parameters (the same bus bytes per byte moved).
"""
from __future__ import annotations

import dataclasses
import functools
import math

from trainspec.core.decoder_shape import DecoderShape
from trainspec.core.pipeline.schedule import run
from trainspec.core.pipeline.stages import INTERLEAVED
from trainspec.core.plan.hardware import Profile, bus_factor

ROLES = ("data", "fsdp", "tensor", "pipeline", "context", "expert")
# minor (inside a host first) to major: tensor traffic is per matmul, data's once per step
HOST_ORDER = ("tensor", "context", "expert", "fsdp", "data", "pipeline")


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per parameter of the parameters, gradients and optimizer state, and per
    activation element."""

    param: int
    grad: int
    optimizer: int
    activation: int = 2


# ZeRO's mixed precision (Rajbhandari et al. 2020): 16-bit parameters and gradients, float32
# master copy and Adam moments (K = 12)
MIXED = Precision(param=2, grad=2, optimizer=12)


@dataclasses.dataclass(frozen=True)
class Layout:
    sizes: dict[str, int]       # role -> size; missing roles are 1
    micro_batch: int            # sequences per micro-batch of one pipeline (data replica)
    micro_batches: int          # micro-batches per step
    seq_len: int
    precision: Precision = MIXED
    zero: int = 0               # ZeRO stage: 1 splits the optimizer state, 2 the gradients too
    full_remat: bool = False    # keep only each layer's input; recompute one layer at a time
    dispatch_rows: int | None = None  # rows per token an all-to-all carries; None: top_k
    schedule: str = "1f1b"      # the pipeline's (trainspec.core.pipeline.schedule)
    virtual_stages: int = 1     # chunks per stage under "interleaved_1f1b"

    def size(self, role: str) -> int:
        return self.sizes.get(role, 1)

    @property
    def n_devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def replicas(self) -> int:
        """Ways the batch is split: data, fsdp and expert (an expert axis is a data axis to
        everything but the experts)."""
        return self.size("data") * self.size("fsdp") * self.size("expert")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.replicas

    @property
    def tokens(self) -> float:
        """Token positions of one micro-batch on one device: split by context, and by tensor
        (sequence parallelism)."""
        return self.micro_batch * self.seq_len / self.size("context") / self.size("tensor")


@functools.lru_cache(maxsize=256)
def executed_pipeline(schedule: str, stages: int, micro_batches: int,
                      virtual: int) -> tuple[float, float]:
    """(idle fraction, micro-batches of activations the first stage holds at its peak) of the
    schedule as executed (one micro-batch, no pipeline: (0, 1))."""
    if stages == 1:
        return 0.0, 1.0
    timeline = run(schedule, stages, micro_batches, virtual)
    return timeline.idle_fraction(), max(timeline.in_flight(0)) / timeline.virtual


def pipeline_of(lay: Layout) -> tuple[float, float]:
    return executed_pipeline(lay.schedule, lay.size("pipeline"), lay.micro_batches,
                             lay.virtual_stages)


def local_params(shape: DecoderShape, lay: Layout) -> tuple[float, float]:
    """(non-expert, expert) parameters on one device."""
    split = lay.size("fsdp") * lay.size("tensor") * lay.size("pipeline")
    return shape.non_expert_params / split, shape.expert_params / (split * lay.size("expert"))


def token_layer_elements(shape: DecoderShape, moe_layer: bool) -> float:
    """Activation elements one token keeps in one layer for the backward pass (no remat,
    flash attention): the block input, two norm outputs and the mid residual (4 d); q, k, v
    and the attention output, one log-sum-exp per head; the MLP's hidden units (2 or 3 per
    unit: input, gate, activation), for a MoE layer top_k routed and the shared experts'
    units, the router logits and the dispatched and combined rows (2 top_k d)."""
    d, v_dim = shape.d_model, shape.v_head_dim or shape.head_dim
    attention = (shape.n_heads + shape.kv_heads) * (shape.head_dim + v_dim) + shape.n_heads
    per_unit = 3 if shape.gated_mlp else 2
    if moe_layer:
        units = (shape.top_k + shape.shared_experts) * (shape.expert_d_ff or shape.d_ff)
        mlp = per_unit * units + shape.experts + 2 * shape.top_k * d
    else:
        mlp = per_unit * shape.d_ff
    return 4 * d + attention + mlp


def memory(shape: DecoderShape, lay: Layout) -> dict[str, float]:
    """Bytes per device of each part, and "total"."""
    p = lay.precision
    dense, expert = local_params(shape, lay)
    replicas = lay.size("data") * lay.size("context")  # an expert's replicas
    split = dense / (replicas * lay.size("expert")) + expert / replicas  # ZeRO's share
    layers = math.ceil(shape.n_layers / lay.size("pipeline"))
    moe_share = shape.moe_layers / shape.n_layers
    per_layer = (moe_share * token_layer_elements(shape, True)
                 + (1 - moe_share) * token_layer_elements(shape, False))
    in_flight = pipeline_of(lay)[1]
    kept = shape.d_model if lay.full_remat else per_layer
    out = {
        "params": (dense + expert) * p.param,
        "gradients": (split if lay.zero >= 2 else dense + expert) * p.grad,
        "optimizer": (split if lay.zero >= 1 else dense + expert) * p.optimizer,
        "activations": lay.tokens * p.activation * (in_flight * layers * kept
                                                    + (per_layer if lay.full_remat else 0)),
        "logits": lay.tokens * shape.vocab * 4,  # float32 logits of one micro-batch, last stage
    }
    out["total"] = sum(out.values())
    return out


def comm_bytes(shape: DecoderShape, lay: Layout) -> dict[str, float]:
    """Bytes each device sends per step, by role (S: the collective's size per device)."""
    p = lay.precision
    layers_here = shape.n_layers / lay.size("pipeline")
    moe_here = shape.moe_layers / lay.size("pipeline")
    t, c, e, f = (lay.size(r) for r in ("tensor", "context", "expert", "fsdp"))
    kv = lay.tokens * shape.kv_heads * (shape.head_dim + (shape.v_head_dim or shape.head_dim))
    dense, expert = local_params(shape, lay)
    activation = lay.tokens * shape.d_model * p.activation  # one micro-batch's, on one device
    return {
        # S of a sequence-parallel all-gather or reduce-scatter: the gathered activation
        "tensor": ((12 if lay.full_remat else 8) * activation * t * layers_here
                   * lay.micro_batches if t > 1 else 0.0),
        "pipeline": (2 * lay.virtual_stages * activation * lay.micro_batches
                     if lay.size("pipeline") > 1 else 0.0),
        "context": ((3 if lay.full_remat else 2) * (c - 1) * kv * p.activation * layers_here
                    * lay.micro_batches),
        "expert": (4 * lay.tokens * (lay.dispatch_rows or shape.top_k) * shape.d_model
                   * p.activation * moe_here * lay.micro_batches if e > 1 else 0.0),
        # FSDP (ZeRO-3): the parameters gathered for the forward and again for the backward,
        # the gradients reduce-scattered, every micro-batch
        "fsdp": ((2 * p.param + p.grad) * (dense + expert) * f * lay.micro_batches
                 if f > 1 else 0.0),
        "data": ((dense + expert) * (p.grad + (p.param if lay.zero else 0))
                 if lay.size("data") * c * e > 1 else 0.0),
    }


# Traffic inside a pipeline stage's work, stretched by its bubble; data's runs once a step.
PER_MICRO_BATCH = ("tensor", "pipeline", "context", "expert", "fsdp")


def _collective(role: str, lay: Layout) -> tuple[str, int]:
    """The collective kind (for nccl-tests' bus factor) and group of a role's traffic."""
    c, e = lay.size("context"), lay.size("expert")
    return {"tensor": ("reduce_scatter", lay.size("tensor")), "pipeline": ("permute", 2),
            "context": ("permute", c), "expert": ("all_to_all", e),
            "fsdp": ("reduce_scatter", lay.size("fsdp")),
            "data": ("reduce_scatter" if lay.zero else "all_reduce",
                     lay.size("data") * c * e)}[role]


def _link_groups(lay: Layout, profile: Profile) -> dict[str, bool]:
    """Whether each role's group lies within one host (its traffic on ICI)."""
    inner, out = 1, {}
    for role in HOST_ORDER:
        inner *= lay.size(role)
        out[role] = inner <= profile.devices_per_host
    return out


def hardware_flops_per_token(shape: DecoderShape, lay: Layout) -> float:
    """The model's FLOPs, and with full remat every layer's forward once more: 2 x the
    layers' active parameters (all but the embedding and the head) and a third of the
    attention's."""
    model = shape.model_flops_per_token(lay.seq_len)
    if not lay.full_remat:
        return model
    ends = shape.embedding_params * (1 if shape.tied_embeddings else 2)
    return model + 2.0 * (shape.active_params - ends) + shape.attention_flops_per_token(
        lay.seq_len, "no_causal_discount") / 3


@dataclasses.dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: dict[str, float]
    comm: dict[str, float]
    step_time_s: float
    fits: bool
    compute_s: float = 0.0      # hardware FLOPs at the achievable rate
    bubble_s: float = 0.0       # the pipeline's idle time
    exposed_comm_s: float = 0.0
    mfu: float = 0.0            # model FLOPs / (step time x devices x peak)


def estimate(shape: DecoderShape, lay: Layout, profile: Profile,
             dtype: str = "bfloat16") -> Estimate:
    """Memory, communication and a step time: compute (the hardware FLOPs at the profile's
    achievable FLOP/s) and each role's traffic at its link's bus bandwidth, of which
    (1 - comm_overlap) is exposed; the stage's work (compute and the traffic inside it) is
    stretched by the executed schedule's idle fraction b, / (1 - b); data's reduction, once a
    step, is outside the pipeline's flush. More stages than layers cannot run (a stage
    without a layer): no estimate, it does not fit."""
    if lay.size("pipeline") > shape.n_layers:
        return Estimate(lay, {"total": math.inf}, {}, math.inf, False)
    mem, comm = memory(shape, lay), comm_bytes(shape, lay)
    tokens = lay.global_batch * lay.seq_len
    compute = (hardware_flops_per_token(shape, lay) * tokens / lay.n_devices
               / profile.device_flops(dtype, profile.devices_per_host))
    inside = _link_groups(lay, profile)
    exposed = {"stage": 0.0, "step": 0.0}
    for role, nbytes in comm.items():
        if nbytes:
            kind, group = _collective(role, lay)
            link = profile.ici if inside[role] else profile.dcn
            exposed["stage" if role in PER_MICRO_BATCH else "step"] += link.time(
                nbytes * bus_factor(kind, group)) * (1 - profile.comm_overlap)
    bubble = pipeline_of(lay)[0]
    stage = (compute + exposed["stage"]) / (1 - bubble)
    step = stage + exposed["step"]
    model_flops = shape.model_flops_per_token(lay.seq_len) * tokens
    return Estimate(lay, mem, comm, step, mem["total"] <= profile.memory_bytes,
                    compute_s=compute, bubble_s=stage * bubble,
                    exposed_comm_s=exposed["stage"] + exposed["step"],
                    mfu=model_flops / (step * lay.n_devices * profile.peak(dtype)))


def ranked(estimates: list[Estimate]) -> list[Estimate]:
    """Those that fit first, fastest first; the rest by memory."""
    return sorted(estimates, key=lambda e: (not e.fits, e.step_time_s if e.fits
                                            else e.memory["total"]))


def layouts(n_devices: int, base: Layout, roles: tuple[str, ...],
            tensor_within: int | None = None) -> list[Layout]:
    """Every assignment of n_devices to `roles` (each a divisor of n), `data` taking what is
    left, the tensor axis within `tensor_within` devices. The global batch stays base's: the
    replicas share its micro-batches (a layout whose replicas do not divide it is left out, as
    is one whose micro-batches the interleaved schedule cannot run: not a multiple of the
    pipeline's stages, Narayanan et al. 2021)."""
    sizes = [{}]
    for role in roles:
        sizes = [{**s, role: f} for s in sizes for f in _divisors(n_devices)
                 if n_devices % (math.prod(s.values()) * f) == 0
                 and not (role == "tensor" and tensor_within and f > tensor_within)]
    out = []
    for s in sizes:
        lay = dataclasses.replace(base, sizes={**s, "data": n_devices // math.prod(s.values())})
        per_replica, rest = divmod(base.global_batch, lay.replicas * base.micro_batch)
        interleaved = base.schedule == INTERLEAVED and lay.size("pipeline") > 1
        if per_replica and not rest and not (interleaved and per_replica % lay.size("pipeline")):
            out.append(dataclasses.replace(lay, micro_batches=per_replica))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
