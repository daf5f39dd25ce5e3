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
from trainspec.core.mesh import ParallelDims
from trainspec.core.spec import Spec


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


def check(spec: Spec, layout: ParallelDims) -> list[str]:
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
    shards = fsdp * layout.replicas
    if spec.batch.micro % shards:
        reasons.append(f"batch.micro_batch {spec.batch.micro} is not divisible by the {shards} "
                       "batch shards (data x fsdp)")
    return reasons


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


def predict(spec: Spec, layout: ParallelDims, profile: Profile, model_flops_per_token: float,
            hardware_flops_per_token: float) -> Prediction:
    """Memory, communication, FLOPs, step time and MFU of `spec` under `layout` on `profile`.

    step time = compute + overhead + update + (1 - comm_overlap) x communication: compute is
    the hardware FLOPs of one device at `achievable_fraction` of its peak, update the
    state-sized memory traffic (`update_bytes`) at the profile's memory bandwidth, and each
    collective operation costs its link's latency for its group + bus bytes / bandwidth, on
    its ICI part and on its DCN part (hierarchically)."""
    n = layout.world_size
    reasons = check(spec, layout)
    tokens = spec.batch.global_batch * spec.batch.seq_len
    model_flops = model_flops_per_token * tokens
    hardware_flops = hardware_flops_per_token * tokens
    dtype = spec.precision.compute
    per_host = min(n, profile.devices_per_host)
    compute_s = hardware_flops / n / profile.device_flops(dtype, per_host)
    comms = collectives(spec, layout, profile) if not reasons else []
    ici = sum(profile.ici.time(c.ici_bus_bytes, c.ops, c.group // c.group_dcn)
              for c in comms if c.group > c.group_dcn)
    dcn = sum(profile.dcn.time(c.dcn_bus_bytes, c.ops, c.group_dcn) for c in comms if c.group_dcn > 1)
    comm_s = {"ici": ici, "dcn": dcn, "exposed": (ici + dcn) * (1 - profile.comm_overlap)}
    overhead_s = profile.program_overhead_s
    mem = memory(spec, layout, profile) if not reasons else {"total": float("nan")}
    traffic = (update_bytes(mem, spec.batch.accumulation_steps, guard_meets(spec))
               if not reasons else 0.0)
    update_s = profile.memory_time(traffic, per_host)
    step = compute_s + overhead_s + update_s + comm_s["exposed"]
    peak = profile.peak(dtype) / (per_host if profile.shared_host_compute else 1)
    if not reasons and mem["total"] > profile.memory_bytes:
        biggest = max(ARGUMENTS + PHASES[peak_phase(mem)], key=mem.get)
        reasons.append(
            f"memory: {mem['total'] / 1e9:.1f} GB per device exceeds the "
            f"{profile.memory_bytes / 1e9:.0f} GB of {profile.name}; largest part {biggest} "
            f"{mem[biggest] / 1e9:.1f} GB ({_remedy(biggest, profile)})")
    return Prediction(
        layout=layout.shape, dcn=layout.dcn_shape, n_devices=n, memory=mem,
        collectives=comms, model_flops_per_step=model_flops, hardware_flops_per_step=hardware_flops,
        compute_s=compute_s, overhead_s=overhead_s, update_s=update_s, comm_s=comm_s, step_time_s=step,
        mfu=model_flops / (step * n * peak) if step > 0 else 0.0, tokens_per_step=tokens,
        fits=not reasons, reasons=reasons)


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


