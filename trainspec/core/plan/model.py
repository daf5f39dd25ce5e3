"""The planning model: memory, communication, FLOPs and step time of one layout, per device.

Everything is a formula of the spec (model, batch, precision, remat, layout rules), the mesh
axis sizes (with their cross-host `dcn` factors) and a hardware profile; nothing is compiled.
docs/plan.md states each formula; tests/jax/test_plan_compiled.py and tests/jax/test_plan_grid.py
hold memory and communication to the programs XLA:CPU compiles here, bench/plan_step_time.py
step time to the steps it runs.

The parts: where the state lives (plan.shards), the collectives (plan.comm) and the memory
(plan.memory); here they are put together with the compute into a step time.
"""
from __future__ import annotations

import dataclasses

from trainspec.core.plan.comm import Collective, collectives, guard_meets
from trainspec.core.plan.hardware import Profile
from trainspec.core.plan.memory import ARGUMENTS, PHASES, memory, peak_phase
from trainspec.core.plan.sequence_experts import batch_axes
from trainspec.core.plan.pipeline import PipelinePlan, pipeline_plan, pipeline_reasons
from trainspec.core.plan.shards import Stage
from trainspec.core.mesh import ParallelDims
from trainspec.core.spec import Spec
from trainspec.core.spec_sequence import sequence_and_expert_errors
from trainspec.core.transformer_flops import TransformerFlops


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
    bubble_s: float = 0.0   # the pipeline's idle time (plan.pipeline), part of step_time_s
    pipeline: dict | None = None

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


def check(spec: Spec, layout: ParallelDims, profile: Profile) -> list[str]:
    """Why this layout cannot run the spec (empty if it can); each reason names a field."""
    m, reasons = spec.model, []
    tensor, fsdp = layout.tensor, layout.fsdp
    for field, value in (("model.n_heads", m.n_heads), ("model.d_ff", m.d_ff),
                         ("model.vocab_size", m.vocab_size)):
        if value % tensor:
            reasons.append(f"mesh tensor size {tensor} does not divide {field} {value}: that "
                           "dimension would stay whole on every device")
    if m.d_model % fsdp:
        reasons.append(f"mesh fsdp size {fsdp} does not divide model.d_model {m.d_model}: the "
                       "parameters would not be sharded")
    shards = layout.group(batch_axes(layout))[0]
    if spec.batch.micro % shards:
        reasons.append(f"batch.micro_batch {spec.batch.micro} is not divisible by the {shards} "
                       "batch shards (data x fsdp x expert)")
    return reasons + sequence_expert_reasons(spec, layout, profile) + pipeline_reasons(
        spec, layout, shards)


def sequence_expert_reasons(spec: Spec, layout: ParallelDims, profile: Profile) -> list[str]:
    """The context and expert layouts this planner models: the reference model's, beside
    data parallelism, as XLA:CPU compiles them (docs/plan.md); elsewhere the sharded-decoder
    planner models them."""
    split = [r for r in ("context", "expert") if layout.split(r)]
    if spec.model.moe is None and not split:
        return []
    if profile.backend != "XLA:CPU":
        return [f"model.moe and context or expert axes on {profile.name}: this planner holds "
                "them to XLA:CPU's programs only; plan them with "
                "trainspec.core.plan.sharded_decoder (docs/plan.md)"]
    beside = [r for r in ("fsdp", "tensor", "pipeline") if layout.split(r)]
    if beside:
        return [f"mesh {beside[0]} beside {'model.moe' if not split else split[0]}: this "
                "planner models context and expert layouts beside data only"]
    return [f"{field}: {message}" for field, message in sequence_and_expert_errors(
        spec, layout.shape)]


# Per micro-batch on a stage, and so stretched by the pipeline's bubble; the other collectives
# run once per step, outside the pipeline's flush.
PER_MICRO_BATCH = ("tensor", "pipeline")


def stage_flops_share(spec: Spec, stage: Stage | None) -> float:
    """The stage's part of the model's hardware FLOPs: its layers, the embedding's on the
    first stage and the head's on the last (trainspec.core.transformer_flops)."""
    whole = TransformerFlops(spec.model, spec.batch.seq_len, spec.remat.policy)
    if stage is None:
        return 1.0
    m = spec.model
    part = TransformerFlops(m.model_copy(update={"n_layers": len(stage.layers)}),
                            spec.batch.seq_len, spec.remat.policy)
    ends = (not stage.first) * 4.0 * m.vocab_size * m.d_model + (not stage.last) * 6.0 * (
        m.vocab_size * m.d_model)
    return (part.hardware_per_token() - ends) / whole.hardware_per_token()


def update_bytes(mem: dict[str, float], micro_batches: int, guard_copies: bool) -> float:
    """Memory traffic per device of the step's work on whole state-sized buffers: each
    micro-batch adds its gradient into the accumulator (reads both, writes one); the data
    reduction packs the gradient into one buffer and back; the update reads the parameters,
    optimizer state and gradients and writes the new parameters and optimizer state; under
    skip and halt the NaN guard copies the state it keeps (read and write; `PHASES`), under
    rollback it adds nothing to the step (the state is checked before checkpoints only). Data
    parallelism replicates all of it on every device; fsdp and tensor split it."""
    state = mem["params"] + mem["optimizer"]
    return (3 * micro_batches * mem["gradients"] + 2 * mem["data_reduction_buffer"]
            + 2 * state + mem["gradients"] + (2 * state if guard_copies else 0))


@dataclasses.dataclass
class _StageTime:
    stage: Stage | None
    memory: dict[str, float]
    collectives: list[Collective]
    compute_s: float
    update_s: float
    comm_s: dict[str, float]
    bubble_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.update_s + self.comm_s["exposed"] + self.bubble_s


def _stage(spec: Spec, layout: ParallelDims, profile: Profile, hardware_flops: float,
           stage: Stage | None, plan: PipelinePlan | None) -> _StageTime:
    """Memory and time of one stage (of the whole model without a pipeline)."""
    n, dtype = layout.world_size, spec.precision.compute
    per_host = min(n, profile.devices_per_host)
    m = plan.microbatches if plan else 1
    in_flight = plan.in_flight[stage.index] if plan else 1.0
    compute_s = (hardware_flops * stage_flops_share(spec, stage) / (n // layout.stages)
                 / profile.device_flops(dtype, per_host))
    comms = collectives(spec, layout, profile, stage, m)
    role_of = dict(zip(layout.names, layout.roles))

    def exposed(per_micro_batch: bool) -> tuple[float, float]:
        chosen = [c for c in comms
                  if any(role_of[a] in PER_MICRO_BATCH for a in c.axes) == per_micro_batch]
        ici = sum(profile.ici.time(c.ici_bus_bytes, c.ops, c.group // c.group_dcn)
                  for c in chosen if c.group > c.group_dcn)
        dcn = sum(profile.dcn.time(c.dcn_bus_bytes, c.ops, c.group_dcn)
                  for c in chosen if c.group_dcn > 1)
        return ici, dcn

    (ici_mb, dcn_mb), (ici_step, dcn_step) = exposed(True), exposed(False)
    ici, dcn = ici_mb + ici_step, dcn_mb + dcn_step
    comm_s = {"ici": ici, "dcn": dcn, "exposed": (ici + dcn) * (1 - profile.comm_overlap)}
    pipelined = compute_s + (ici_mb + dcn_mb) * (1 - profile.comm_overlap)
    bubble_s = pipelined * plan.bubble / (1 - plan.bubble) if plan else 0.0
    mem = memory(spec, layout, profile, stage, m, in_flight)
    traffic = update_bytes(mem, spec.batch.accumulation_steps, guard_meets(spec))
    return _StageTime(stage, mem, comms, compute_s, profile.memory_time(traffic, per_host),
                      comm_s, bubble_s)


def predict(spec: Spec, layout: ParallelDims, profile: Profile, model_flops_per_token: float,
            hardware_flops_per_token: float) -> Prediction:
    """Memory, communication, FLOPs, step time and MFU of `spec` under `layout` on `profile`.

    step time = compute + overhead + update + (1 - comm_overlap) x communication + bubble:
    compute is the hardware FLOPs of one device at `achievable_fraction` of its peak, update
    the state-sized memory traffic (`update_bytes`) at the profile's memory bandwidth, and each
    collective operation costs its link's latency for its group + bus bytes / bandwidth, on
    its ICI part and on its DCN part (hierarchically). With a pipeline the slowest stage sets
    the time and the fullest the memory; what a stage does per micro-batch (compute, its
    tensor and point-to-point traffic) is stretched by the executed schedule's idle fraction
    b: bubble = that work x b / (1 - b)."""
    n = layout.world_size
    reasons = check(spec, layout, profile)
    if layout.stages > 1 and profile.backend == "XLA:CPU":
        reasons.append(f"mesh pipeline size {layout.stages}: the {profile.name} profile's "
                       "XLA:CPU memory counts were read off steps without a pipeline, and the "
                       "JAX pipeline's traffic is not the plan's (docs/plan.md)")
    tokens = spec.batch.global_batch * spec.batch.seq_len
    model_flops = model_flops_per_token * tokens
    hardware_flops = hardware_flops_per_token * tokens
    dtype = spec.precision.compute
    per_host = min(n, profile.devices_per_host)
    overhead_s = profile.program_overhead_s
    peak = profile.peak(dtype) / (per_host if profile.shared_host_compute else 1)
    if reasons:
        compute_s = hardware_flops / n / profile.device_flops(dtype, per_host)
        step = compute_s + overhead_s
        return Prediction(
            layout=layout.shape, dcn=layout.dcn_shape, n_devices=n, memory={"total": float("nan")},
            collectives=[], model_flops_per_step=model_flops, hardware_flops_per_step=hardware_flops,
            compute_s=compute_s, overhead_s=overhead_s, update_s=0.0,
            comm_s={"ici": 0.0, "dcn": 0.0, "exposed": 0.0}, step_time_s=step,
            mfu=model_flops / (step * n * peak) if step > 0 else 0.0, tokens_per_step=tokens,
            fits=False,
            reasons=reasons)
    plan = pipeline_plan(spec, layout) if layout.stages > 1 else None
    stages = [_stage(spec, layout, profile, hardware_flops, s, plan)
              for s in (plan.considered() if plan else [None])]
    slowest = max(stages, key=lambda s: s.total_s)
    mem = max((s.memory for s in stages), key=lambda m: m["total"])
    step = slowest.total_s + overhead_s
    if mem["total"] > profile.memory_bytes:
        biggest = max(ARGUMENTS + PHASES[peak_phase(mem)], key=mem.get)
        reasons.append(
            f"memory: {mem['total'] / 1e9:.1f} GB per device exceeds the "
            f"{profile.memory_bytes / 1e9:.0f} GB of {profile.name}; largest part {biggest} "
            f"{mem[biggest] / 1e9:.1f} GB ({_remedy(biggest, profile)})")
    return Prediction(
        layout=layout.shape, dcn=layout.dcn_shape, n_devices=n, memory=mem,
        collectives=slowest.collectives, model_flops_per_step=model_flops,
        hardware_flops_per_step=hardware_flops, compute_s=slowest.compute_s,
        overhead_s=overhead_s, update_s=slowest.update_s, comm_s=slowest.comm_s,
        step_time_s=step, mfu=model_flops / (step * n * peak) if step > 0 else 0.0,
        tokens_per_step=tokens, fits=not reasons, reasons=reasons, bubble_s=slowest.bubble_s,
        pipeline=({**plan.as_dict(), "considered": [
            {"stage": s.stage.index, "memory": s.memory["total"],
             "activations": s.memory["activations"], "time_s": s.total_s + overhead_s}
            for s in stages]} if plan else None))


_REMEDIES = {
    "params": "raise the fsdp or tensor size, or precision.param = \"bfloat16\"",
    "optimizer": "layout.optimizer_state = \"shard_over_data\", or a larger fsdp size",
    "gradients": "precision.grad_reduce = \"bfloat16\", or a larger fsdp size",
    "gathered_params": "raise the tensor size",
    "weights_in_use": "raise the tensor size",
    "outer_state": "a larger fsdp or tensor size",
    "unreduced_gradient": "precision.grad_reduce = \"bfloat16\", or a larger tensor size",
    "reduce_scatter_output": "precision.grad_reduce = \"bfloat16\", or a larger tensor size",
    "data_reduction_buffer": "precision.grad_reduce = \"bfloat16\", or a larger fsdp size",
    "new_state": "a larger fsdp size, or layout.optimizer_state = \"shard_over_data\"",
    "kept_state_copy": "a larger fsdp or tensor size",
    "batch": "a smaller batch.global_batch",
    "activations": "remat.policy = \"full\", a smaller batch.micro_batch, or a larger tensor size",
}


def _remedy(part: str, profile: Profile) -> str:
    if part == "activations" and profile.backend == "XLA:CPU":  # remat saves nothing there
        return "a smaller batch.micro_batch, or a larger tensor size"
    return _REMEDIES[part]


