"""The planning model: memory, communication, FLOPs and step time of one layout, per device.

Everything is a formula of the spec (model, batch, precision, remat, layout rules), the mesh
axis sizes (with their cross-host `dcn` factors) and a hardware profile; nothing is compiled.
docs/plan.md states each formula; tests/test_plan.py holds them against what XLA compiles and
runs here.

The communication follows how the train step (trainspec.jax.step) computes, per step with K
micro-batches, R rows per device and micro-batch, T tokens per row, L layers, width d:
- fsdp > 1: the parameters are all-gathered over fsdp once per step (XLA hoists the gather
  out of the micro-batch loop), the norm scales twice (`Param.gathers`), and each
  micro-batch's gradient is reduce-scattered over fsdp (XLA:CPU emits an all-reduce of the
  same S: `reduce_scatter_as_all_reduce`);
- data > 1: one all-reduce of the packed local gradient shard per step (the explicit replica
  reduction of step.py when K > 1 or the backend is not xla);
- tensor > 1: per micro-batch, all-reduces of (2 + 6 L) activations of R x T x d elements
  (forward: embedding, attention and MLP outputs; backward: the input gradients of the head,
  mlp_in, q, k and v) plus 4 per-token scalars of the vocabulary-split softmax loss, in
  (2 + 4 L) + 3 operations (XLA combines the q, k and v input gradients into one all-reduce,
  one scalar rides with an activation).
- every step on more than one device: the NaN guard's (health.nan) all-reduce of one int32,
  its count of non-finite state slices, over the whole mesh.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from trainspec.core.layout_rules import dim_axes, logical_rules
from trainspec.core.plan.hardware import Profile, bus_factor
from trainspec.core.plan.transformer import parameters, token_activations
from trainspec.core.spec import Spec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER_COPIES = {"adamw": 2, "sgd": 1}  # mu and nu; momentum (in the parameter dtype)
BATCH_BYTES_PER_TOKEN = 12  # int32 inputs, targets and mask
LOSS_SCALARS_PER_TOKEN = 4  # vocabulary-split log-softmax: max, sum, target logit, backward sum
LOSS_OPS = 3  # the all-reduces that carry them (XLA sends one along with an activation)


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    bytes: float        # S per device per call (nccl-tests' convention, as metrics/comm.py)
    calls: int
    group: int          # devices in one group
    group_dcn: int      # of which across hosts: the group spans group_dcn ICI domains
    ops: int            # collective operations per step, each paying the link's latency

    @property
    def bytes_per_step(self) -> float:
        return self.bytes * self.calls

    @property
    def ici_bus_bytes(self) -> float:
        return self.bytes_per_step * bus_factor(self.kind, self.group // self.group_dcn)

    @property
    def dcn_bus_bytes(self) -> float:
        """Hierarchical: the cross-host stage moves the 1/ici share each domain holds."""
        ici = self.group // self.group_dcn
        return self.bytes_per_step / ici * bus_factor(self.kind, self.group_dcn)


@dataclasses.dataclass
class Prediction:
    layout: dict[str, int]
    dcn: dict[str, int]
    n_devices: int
    memory: dict[str, float]
    collectives: list[Collective]
    model_flops_per_step: float
    hardware_flops_per_step: float
    compute_s: float
    overhead_s: float
    update_s: float     # memory traffic of the gradient accumulation, reduction and update
    comm_s: dict[str, float]
    step_time_s: float
    mfu: float
    tokens_per_step: int
    fits: bool = True
    reasons: list[str] = dataclasses.field(default_factory=list)

    @property
    def memory_bytes(self) -> float:
        return self.memory["total"]

    def comm_by_kind_and_axis(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for c in self.collectives:
            key = "+".join(c.axes)
            out.setdefault(c.kind, {}).setdefault(key, 0.0)
            out[c.kind][key] += c.bytes_per_step
        return out

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["comm_bytes_by_kind_and_axis"] = self.comm_by_kind_and_axis()
        d["comm_ici_bus_bytes"] = sum(c.ici_bus_bytes for c in self.collectives)
        d["comm_dcn_bus_bytes"] = sum(c.dcn_bus_bytes for c in self.collectives)
        return d


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh axis sizes and their cross-host factors, in the spec's axis order."""

    sizes: Mapping[str, int]
    dcn: Mapping[str, int]

    @property
    def n_devices(self) -> int:
        return math.prod(self.sizes.values())

    def group(self, axes) -> tuple[int, int]:
        return (math.prod(self.sizes[a] for a in axes), math.prod(self.dcn[a] for a in axes))


def _role_axes(spec: Spec, layout: Layout, role: str) -> tuple[str, ...]:
    return tuple(a for a in spec.mesh.axes_with_role(role) if layout.sizes[a] > 1)


def check(spec: Spec, layout: Layout) -> list[str]:
    """Why this layout cannot run the spec (empty if it can); each reason names a field."""
    m, reasons = spec.model, []
    tensor = math.prod(layout.sizes[a] for a in _role_axes(spec, layout, "tensor"))
    fsdp = math.prod(layout.sizes[a] for a in _role_axes(spec, layout, "fsdp"))
    for field, value in (("model.n_heads", m.n_heads), ("model.d_ff", m.d_ff),
                         ("model.vocab_size", m.vocab_size)):
        if value % tensor:
            reasons.append(f"mesh tensor size {tensor} does not divide {field} {value}: that "
                           "dimension would stay whole on every device")
    if m.d_model % fsdp:
        reasons.append(f"mesh fsdp size {fsdp} does not divide model.d_model {m.d_model}: the "
                       "parameters would not be sharded")
    shards = fsdp * math.prod(layout.sizes[a] for a in _role_axes(spec, layout, "data"))
    if spec.batch.micro % shards:
        reasons.append(f"batch.micro_batch {spec.batch.micro} is not divisible by the {shards} "
                       "batch shards (data x fsdp)")
    return reasons


def _local_elements(spec: Spec, layout: Layout, rules, skip: tuple[str, ...] = ()):
    """(param, elements on one device) with the mesh axes in `skip` treated as size 1."""
    shape = {a: (1 if a in skip else s) for a, s in layout.sizes.items()}
    for p in parameters(spec.model):
        used: set[str] = set()
        split = 1
        for dim, logical in zip(p.shape, p.logical):
            split *= math.prod(shape[a] for a in dim_axes(rules, logical, dim, shape, used))
        yield p, p.size // split, used


def _optimizer_elements(spec: Spec, layout: Layout, rules) -> float:
    """Optimizer-state elements per device per copy: like the parameter, or (ZeRO-1) split
    over the free data axes when a free dimension divides evenly (as trainspec.jax.layout)."""
    data = _role_axes(spec, layout, "data")
    total = 0.0
    for p, local, used in _local_elements(spec, layout, rules):
        free = [a for a in data if a not in used]
        n = math.prod(layout.sizes[a] for a in free)
        if spec.layout.optimizer_state == "shard_over_data" and n > 1:
            if any(not any(a in used for a in rules.get(lg, ())) and dim % n == 0
                   for dim, lg in zip(p.shape, p.logical)):
                local //= n
        total += local
    return total


ARGUMENTS = ("params", "optimizer", "batch")  # the step's inputs, live throughout
# What the step holds besides its arguments, phase by phase; the peak is the largest phase.
PHASES = {
    # a micro-batch's forward and backward: the gradient accumulator, the fsdp-gathered
    # parameters (gathered once, before the micro-batch loop) and the activations
    "micro_batches": ("gradients", "gathered_params", "activations"),
    # fsdp > 1 on XLA:CPU, at the end of each micro-batch: its gradient, whole, and the output
    # of the all-reduce that stands for the reduce-scatter (then sliced)
    "fsdp_reduction": ("gradients", "gathered_params", "unreduced_gradient", "reduce_scatter_output"),
    # after the loop, data > 1: the local gradient and its all-reduced copy
    "data_reduction": ("gradients", "data_reduction_buffer"),
    # the update: the NaN guard (health.nan) chooses between the old state and the new after
    # both exist, so the new parameters and optimizer state are whole beside the old, and the
    # chosen state is copied out leaf by leaf (at most the largest leaf at once)
    "update": ("new_state", "kept_state_copy"),
}


def peak_phase(mem: dict[str, float]) -> str:
    return max(PHASES, key=lambda phase: sum(mem[k] for k in PHASES[phase]))


def memory(spec: Spec, layout: Layout, profile: Profile) -> dict[str, float]:
    """Bytes per device of each part of `ARGUMENTS` and `PHASES`, and "total": the arguments
    and the largest phase (the buffers of one phase are dead in the others, and XLA reuses
    their memory).

    Activations are the elements `transformer.token_activations` counts for the tokens one
    device holds in one micro-batch, the part the tensor axis splits and the part it does not
    each times the profile's overhead factor (what the compiler keeps beyond the count: fusion
    temporaries, the backward's own intermediates; 1 on profiles not calibrated)."""
    rules = logical_rules(spec)
    pb = DTYPE_BYTES[spec.precision.param]
    gb = DTYPE_BYTES[spec.precision.grad_reduce]
    cb = DTYPE_BYTES[spec.precision.compute]
    local = sum(n for _, n, _ in _local_elements(spec, layout, rules))
    fsdp_axes = _role_axes(spec, layout, "fsdp")
    gathered = sum(n for _, n, _ in _local_elements(spec, layout, rules, skip=fsdp_axes))
    copies = OPTIMIZER_COPIES[spec.optimizer.name]
    data = _role_axes(spec, layout, "data")
    whole_reduction = bool(fsdp_axes) and profile.reduce_scatter_as_all_reduce
    out = {
        "params": local * pb,
        "optimizer": copies * _optimizer_elements(spec, layout, rules) * pb,
        "gradients": local * gb,
        "gathered_params": gathered * cb if fsdp_axes else 0.0,
        # XLA:CPU reduces the micro-batch's whole gradient in one all-reduce, then slices; a
        # real reduce-scatter (GPU, TPU) takes each weight's gradient as it is produced and
        # writes its shard into the accumulator
        "unreduced_gradient": gathered * gb if whole_reduction else 0.0,
        "reduce_scatter_output": gathered * gb if whole_reduction else 0.0,
        # the data reduction packs the local gradient into one buffer
        "data_reduction_buffer": local * gb if data else 0.0,
    }
    out["new_state"] = out["params"] + out["optimizer"]
    out["kept_state_copy"] = max(n for _, n, _ in _local_elements(spec, layout, rules)) * pb
    tensor = layout.group(_role_axes(spec, layout, "tensor"))[0]
    shards = layout.group(_role_axes(spec, layout, "fsdp") + data)[0]
    tokens = spec.batch.micro / shards * spec.batch.seq_len
    per_token = token_activations(spec.model, spec.batch.seq_len, spec.remat.policy,
                                  profile.fused_attention)
    out["activations"] = tokens * cb * (
        per_token.replicated * profile.activation_overhead_replicated
        + per_token.split / tensor * profile.activation_overhead)
    out["batch"] = spec.batch.global_batch / shards * spec.batch.seq_len * BATCH_BYTES_PER_TOKEN
    phase = PHASES[peak_phase(out)]
    out["total"] = sum(out[k] for k in ARGUMENTS) + sum(out[k] for k in phase)
    return out


def collectives(spec: Spec, layout: Layout) -> list[Collective]:
    rules = logical_rules(spec)
    gb, cb, pb = (DTYPE_BYTES[spec.precision.grad_reduce], DTYPE_BYTES[spec.precision.compute],
                  DTYPE_BYTES[spec.precision.param])
    k, m = spec.batch.accumulation_steps, spec.model
    data, fsdp, tensor = (_role_axes(spec, layout, r) for r in ("data", "fsdp", "tensor"))
    out = []

    def add(kind, axes, nbytes, calls, ops=None):
        n, n_dcn = layout.group(axes)
        out.append(Collective(kind, axes, float(nbytes), calls, n, n_dcn, calls if ops is None else ops))

    if fsdp:
        full = sum(n for _, n, _ in _local_elements(spec, layout, rules, skip=fsdp))
        # each weight that fsdp splits is gathered `p.gathers` times, whole over fsdp
        gathered = [(p, n) for (p, n, _), (_, _, used) in
                    zip(_local_elements(spec, layout, rules, skip=fsdp),
                        _local_elements(spec, layout, rules)) if used & set(fsdp)]
        regathered = sum((p.gathers - 1) * n for p, n in gathered)
        add("all-gather", fsdp, (full + regathered) * pb, 1, sum(p.gathers for p, _ in gathered))
        add("reduce-scatter", fsdp, full * gb, k)  # kind renamed by the profile if need be
    if data:
        local = sum(n for _, n, _ in _local_elements(spec, layout, rules))
        add("all-reduce", data, local * gb, 1)
    if layout.n_devices > 1:  # the NaN guard's count of non-finite state slices (one int32)
        add("all-reduce", tuple(a for a, size in layout.sizes.items() if size > 1), 4, 1)
    if tensor:
        rows = spec.batch.micro / layout.group(data + fsdp)[0]
        tokens = rows * spec.batch.seq_len
        per_micro = (2 + 6 * m.n_layers) * tokens * m.d_model * cb
        per_micro += LOSS_SCALARS_PER_TOKEN * tokens * 4
        add("all-reduce", tensor, per_micro, k, k * (2 + 4 * m.n_layers + LOSS_OPS))
    return out


def _rename(c: Collective, profile: Profile) -> Collective:
    if c.kind == "reduce-scatter" and profile.reduce_scatter_as_all_reduce:
        return dataclasses.replace(c, kind="all-reduce")
    return c


def update_bytes(mem: dict[str, float], micro_batches: int) -> float:
    """Memory traffic per device of the step's work on whole state-sized buffers: each
    micro-batch adds its gradient into the accumulator (reads both, writes one); the data
    reduction packs the gradient into one buffer and back; the update reads the parameters,
    optimizer state and gradients and writes the new parameters and optimizer state, and the
    NaN guard copies the state it keeps (read and write; `PHASES`). Data parallelism
    replicates all of it on every device; fsdp and tensor split it."""
    state = mem["params"] + mem["optimizer"]
    return (3 * micro_batches * mem["gradients"] + 2 * mem["data_reduction_buffer"]
            + 2 * state + mem["gradients"] + 2 * state)


def predict(spec: Spec, layout: Layout, profile: Profile, model_flops_per_token: float,
            hardware_flops_per_token: float) -> Prediction:
    """Memory, communication, FLOPs, step time and MFU of `spec` under `layout` on `profile`.

    step time = compute + overhead + update + (1 - comm_overlap) x communication: compute is
    the hardware FLOPs of one device at `achievable_fraction` of its peak, update the
    state-sized memory traffic (`update_bytes`) at the profile's memory bandwidth, and each
    collective operation costs its link's latency for its group + bus bytes / bandwidth, on
    its ICI part and on its DCN part (hierarchically)."""
    n = layout.n_devices
    reasons = check(spec, layout)
    tokens = spec.batch.global_batch * spec.batch.seq_len
    model_flops = model_flops_per_token * tokens
    hardware_flops = hardware_flops_per_token * tokens
    dtype = spec.precision.compute
    per_host = min(n, profile.devices_per_host)
    compute_s = hardware_flops / n / profile.device_flops(dtype, per_host)
    comms = [_rename(c, profile) for c in collectives(spec, layout)] if not reasons else []
    ici = sum(profile.ici.time(c.ici_bus_bytes, c.ops, c.group // c.group_dcn)
              for c in comms if c.group > c.group_dcn)
    dcn = sum(profile.dcn.time(c.dcn_bus_bytes, c.ops, c.group_dcn) for c in comms if c.group_dcn > 1)
    comm_s = {"ici": ici, "dcn": dcn, "exposed": (ici + dcn) * (1 - profile.comm_overlap)}
    overhead_s = profile.program_overhead_s
    mem = memory(spec, layout, profile) if not reasons else {"total": float("nan")}
    update_s = (profile.memory_time(update_bytes(mem, spec.batch.accumulation_steps), per_host)
                if not reasons else 0.0)
    step = compute_s + overhead_s + update_s + comm_s["exposed"]
    peak = profile.peak(dtype) / (per_host if profile.shared_host_compute else 1)
    if not reasons and mem["total"] > profile.memory_bytes:
        biggest = max(ARGUMENTS + PHASES[peak_phase(mem)], key=mem.get)
        reasons.append(
            f"memory: {mem['total'] / 1e9:.1f} GB per device exceeds the {profile.memory_bytes / 1e9:.0f} "
            f"GB of {profile.name}; largest part {biggest} {mem[biggest] / 1e9:.1f} GB ({_remedy(biggest)})")
    return Prediction(
        layout=dict(layout.sizes), dcn=dict(layout.dcn), n_devices=n, memory=mem,
        collectives=comms, model_flops_per_step=model_flops, hardware_flops_per_step=hardware_flops,
        compute_s=compute_s, overhead_s=overhead_s, update_s=update_s, comm_s=comm_s, step_time_s=step,
        mfu=model_flops / (step * n * peak) if step > 0 else 0.0, tokens_per_step=tokens,
        fits=not reasons, reasons=reasons)


_REMEDIES = {
    "params": "raise the fsdp or tensor size, or precision.param = \"bfloat16\"",
    "optimizer": "layout.optimizer_state = \"shard_over_data\", or a larger fsdp size",
    "gradients": "precision.grad_reduce = \"bfloat16\", or a larger fsdp size",
    "gathered_params": "raise the tensor size",
    "unreduced_gradient": "precision.grad_reduce = \"bfloat16\", or a larger tensor size",
    "reduce_scatter_output": "precision.grad_reduce = \"bfloat16\", or a larger tensor size",
    "data_reduction_buffer": "precision.grad_reduce = \"bfloat16\", or a larger fsdp size",
    "new_state": "a larger fsdp size, or layout.optimizer_state = \"shard_over_data\"",
    "kept_state_copy": "a larger fsdp or tensor size",
    "batch": "a smaller batch.global_batch",
    "activations": "remat.policy = \"full\", a smaller batch.micro_batch, or a larger tensor size",
}


def _remedy(part: str) -> str:
    return _REMEDIES[part]


def fit_activation_overheads(spec_layouts, profile: Profile) -> Profile:
    """The profile with both activation overhead factors fitted (least squares) to measured
    per-device memory: `spec_layouts` is [(spec, layout, measured bytes)], two or more, with
    different tensor sizes so that the split and the replicated parts can be told apart, and
    activations large enough that the micro-batch phase is the peak (it is the one fitted)."""
    def micro_batch_peak(spec, layout, split, replicated):
        mem = memory(spec, layout, dataclasses.replace(
            profile, activation_overhead=split, activation_overhead_replicated=replicated))
        return sum(mem[k] for k in ARGUMENTS + PHASES["micro_batches"])

    rows = []
    for spec, layout, measured in spec_layouts:
        base = micro_batch_peak(spec, layout, 0.0, 0.0)
        rows.append((micro_batch_peak(spec, layout, 1.0, 0.0) - base,
                     micro_batch_peak(spec, layout, 0.0, 1.0) - base, measured - base))
    sxx = sum(a * a for a, _, _ in rows)
    syy = sum(b * b for _, b, _ in rows)
    sxy = sum(a * b for a, b, _ in rows)
    sxz = sum(a * z for a, _, z in rows)
    syz = sum(b * z for _, b, z in rows)
    det = sxx * syy - sxy * sxy
    if abs(det) < 1e-12 * max(sxx * syy, 1.0):
        raise ValueError("activation fit needs layouts with different tensor sizes")
    split_f = (sxz * syy - syz * sxy) / det
    rep_f = (syz * sxx - sxz * sxy) / det
    return dataclasses.replace(profile, activation_overhead=split_f,
                               activation_overhead_replicated=rep_f)
