"""Memory and communication per device of a decoder at published scale (a DecoderShape)
under data, fsdp, tensor, pipeline, context and expert parallelism, and the ranking of such
layouts (docs/plan.md, "Context and expert layouts").

Where each thing lives, per device:
- parameters outside the experts: split by fsdp x tensor x pipeline, replicated over data,
  expert and context (their gradients summed over those);
- the routed experts' parameters: split by fsdp x tensor x pipeline x expert;
- gradients like their parameters; optimizer state like them, and with ZeRO-1 also split over
  the parameter's replicas;
- activations: each micro-batch's tokens split by context (the ring), all of them by tensor
  (sequence parallelism), the layers by pipeline; 1F1B keeps min(pipeline, micro-batches)
  micro-batches in flight on the first stage.
Communication per device and step, in bytes sent (S of nccl-tests):
- context: the ring passes each rank's key/value block on (context - 1) times per layer and
  micro-batch in the forward pass, and the blocks' gradients back in the backward pass (the
  autodiff of a permute): 2 (context - 1) x the local key/value bytes, 3 with full remat (the
  forward ring again);
- expert: per MoE layer and micro-batch, dispatch and combine in the forward pass and both again
  in the backward pass: 4 all-to-alls of the local tokens x rows per token x d_model x bytes,
  rows per token top_k for a slot-packed dispatch, `experts` for the reference model's
  buffers indexed by token (trainspec.jax.models.moe).
- data: one all-reduce of each gradient over its replicas.
"""
from __future__ import annotations

import dataclasses
import math

from trainspec.core.decoder_shape import DecoderShape
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
    zero1: bool = False
    full_remat: bool = False    # keep only each layer's input; recompute one layer at a time
    dispatch_rows: int | None = None  # rows per token an all-to-all carries; None: top_k

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
    zero = (dense / (replicas * lay.size("expert")) + expert / replicas) if lay.zero1 else None
    tokens = lay.micro_batch * lay.seq_len / lay.size("context") / lay.size("tensor")
    layers = math.ceil(shape.n_layers / lay.size("pipeline"))
    moe_share = shape.moe_layers / shape.n_layers
    per_layer = (moe_share * token_layer_elements(shape, True)
                 + (1 - moe_share) * token_layer_elements(shape, False))
    in_flight = min(lay.size("pipeline"), lay.micro_batches)
    kept = shape.d_model if lay.full_remat else per_layer
    out = {
        "params": (dense + expert) * p.param,
        "gradients": (dense + expert) * p.grad,
        "optimizer": (zero if zero is not None else dense + expert) * p.optimizer,
        "activations": tokens * p.activation * (in_flight * layers * kept
                                                + (per_layer if lay.full_remat else 0)),
        "logits": tokens * shape.vocab * 4,  # float32 logits of one micro-batch, last stage
    }
    out["total"] = sum(out.values())
    return out


def comm_bytes(shape: DecoderShape, lay: Layout) -> dict[str, float]:
    """Bytes each device sends per step, by role (S: the collective's size per device)."""
    p = lay.precision
    tokens = lay.micro_batch * lay.seq_len / lay.size("context") / lay.size("tensor")
    layers_here = shape.n_layers / lay.size("pipeline")
    moe_here = shape.moe_layers / lay.size("pipeline")
    c, e = lay.size("context"), lay.size("expert")
    kv = tokens * shape.kv_heads * (shape.head_dim + (shape.v_head_dim or shape.head_dim))
    dense, expert = local_params(shape, lay)
    return {
        "context": ((3 if lay.full_remat else 2) * (c - 1) * kv * p.activation * layers_here
                    * lay.micro_batches),
        "expert": (4 * tokens * (lay.dispatch_rows or shape.top_k) * shape.d_model
                   * p.activation * moe_here * lay.micro_batches if e > 1 else 0.0),
        "data": (dense + expert) * p.grad if lay.size("data") * c * e > 1 else 0.0,
    }


def _link_groups(lay: Layout, profile: Profile) -> dict[str, bool]:
    """Whether each role's group lies within one host (its traffic on ICI)."""
    inner, out = 1, {}
    for role in HOST_ORDER:
        inner *= lay.size(role)
        out[role] = inner <= profile.devices_per_host
    return out


@dataclasses.dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: dict[str, float]
    comm: dict[str, float]
    step_time_s: float
    fits: bool


def estimate(shape: DecoderShape, lay: Layout, profile: Profile,
             dtype: str = "bfloat16") -> Estimate:
    """Memory, communication and a step time: compute at the profile's achievable FLOP/s,
    each role's traffic at its link's bus bandwidth, the exposed part (1 - comm_overlap),
    and the 1F1B bubble (p - 1) / (m + p - 1) of the compute."""
    mem, comm = memory(shape, lay), comm_bytes(shape, lay)
    tokens = lay.global_batch * lay.seq_len
    flops = shape.model_flops_per_token(lay.seq_len) * tokens / lay.n_devices
    compute = flops / profile.device_flops(dtype, profile.devices_per_host)
    p, m = lay.size("pipeline"), lay.micro_batches
    compute /= 1 - (p - 1) / (m + p - 1)
    inside = _link_groups(lay, profile)
    kinds = {"context": "permute", "expert": "all_to_all", "data": "all_reduce"}
    group = {"context": lay.size("context"), "expert": lay.size("expert"),
             "data": lay.size("data") * lay.size("context") * lay.size("expert")}
    comm_s = sum((profile.ici if inside[role] else profile.dcn).time(
        comm[role] * bus_factor(kinds[role], group[role])) for role in comm if comm[role])
    step = compute + comm_s * (1 - profile.comm_overlap)
    return Estimate(lay, mem, comm, step, mem["total"] <= profile.memory_bytes)


def ranked(estimates: list[Estimate]) -> list[Estimate]:
    """Those that fit first, fastest first; the rest by memory."""
    return sorted(estimates, key=lambda e: (not e.fits, e.step_time_s if e.fits
                                            else e.memory["total"]))


def layouts(n_devices: int, base: Layout, roles: tuple[str, ...],
            tensor_within: int | None = None) -> list[Layout]:
    """Every assignment of n_devices to `roles` (each a divisor of n), `data` taking what is
    left, the tensor axis within `tensor_within` devices. The global batch stays base's: the
    replicas share its micro-batches (a layout whose replicas do not divide it is left out)."""
    sizes = [{}]
    for role in roles:
        sizes = [{**s, role: f} for s in sizes for f in _divisors(n_devices)
                 if n_devices % (math.prod(s.values()) * f) == 0
                 and not (role == "tensor" and tensor_within and f > tensor_within)]
    out = []
    for s in sizes:
        lay = dataclasses.replace(base, sizes={**s, "data": n_devices // math.prod(s.values())})
        per_replica, rest = divmod(base.global_batch, lay.replicas * base.micro_batch)
        if per_replica and not rest:
            out.append(dataclasses.replace(lay, micro_batches=per_replica))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
