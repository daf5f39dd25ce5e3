"""The planner against what runs here: compile and time one layout, calibrate the CPU profile.

`compile_layout` compiles the reference job's step for a spec on the first n devices and
reports what the planner predicts: per-device memory (`compiled.memory_analysis()`), and the
HLO's communication bytes by kind and mesh axis and operations by kind (trainspec.jax.metrics.comm);
`layout_runner` places its state so that `step_time` can time it.
`calibrate_cpu` measures this machine's matmul peak, collective alpha-beta and memory
bandwidth, `calibrate_time` fits the step-time parameters, so that `trainspec plan --hardware
cpu` predicts this machine's step time. tests/core/test_plan.py, tests/jax/test_plan_*.py and
bench/plan_step_time.py use them.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp

from trainspec.core.data import ByteBatches
from trainspec.core.mesh import resolve_mesh
from trainspec.core.plan.hardware import Profile, calibrate, load_profile
from trainspec.core.plan.model import Prediction, predict
from trainspec.core.plan.search import all_layouts
from trainspec.core.spec import Spec, load_spec
from trainspec.jax.mesh import build_mesh
from trainspec.jax.metrics import memory
from trainspec.jax.metrics.cpu_peak import matmul_peak
from trainspec.core.transformer_flops import for_spec
from trainspec.jax.train import build_abstract_job, build_job


# The validation model (docs/plan.md): small enough to compile 30 layouts in a minute
VALIDATION_MODEL = ["model.d_model=128", "model.n_heads=8", "model.d_ff=256", "model.n_layers=1",
                    "batch.seq_len=32"]


def validation_spec(data: int, fsdp: int, tensor: int, dcn: int = 1, rows: int = 8) -> Spec:
    """The validation model on a (data, fsdp, tensor) mesh (data over `dcn` hosts): a
    micro-batch of at least `rows` rows divisible by the batch shards, 2 micro-batches a step."""
    shards = data * fsdp
    micro = shards * -(-rows // shards)
    return load_spec(None, VALIDATION_MODEL + [
        f"mesh.axes.data.size={data}", f"mesh.axes.data.dcn={dcn}", f"mesh.axes.fsdp.size={fsdp}",
        f"mesh.axes.tensor.size={tensor}", f"batch.micro_batch={micro}",
        f"batch.global_batch={2 * micro}"])


def validation_layouts() -> list[tuple[int, int, int, int]]:
    """(data, fsdp, tensor, dcn) of every layout the planner accepts for the validation model
    at 1-8 devices, and 2 processes x 4 (data 2 over 2 hosts, tensor 4)."""
    cpu = load_profile("cpu")
    out = []
    for n in range(1, 9):
        for lay in all_layouts(validation_spec(1, 1, 1), n, cpu.ici_domain):
            d, f, t = (lay.shape[a] for a in ("data", "fsdp", "tensor"))
            if not predict(validation_spec(d, f, t), lay, cpu, 0, 0).reasons:
                out.append((d, f, t, 1))
    return out + [(2, 1, 4, 2)]


def predict_for(spec: Spec, n_devices: int, profile: Profile) -> Prediction:
    f = for_spec(spec)
    return predict(spec, resolve_mesh(spec, n_devices), profile, f.model_per_token(), f.hardware_per_token())


_HOST_STATES: dict[str, list] = {}


def _host_state(spec: Spec) -> list:
    """The initial state's leaves on the host, built once per model: every layout places the
    same values (device_put with its shardings) instead of compiling its own init."""
    key = "".join(s.model_dump_json() for s in (spec.model, spec.optimizer, spec.precision))
    if key not in _HOST_STATES:
        _HOST_STATES[key] = _initial_leaves(spec)
    return _HOST_STATES[key]


def _initial_leaves(spec: Spec) -> list:
    single = spec.model_copy(update={"mesh": _single_mesh(spec)})
    job = build_job(single, build_mesh(single, jax.devices()[:1]))
    return jax.tree.leaves(jax.device_get(job.state))


def _single_mesh(spec: Spec):
    axes = {name: axis.model_copy(update={"size": 1, "dcn": 1}) for name, axis in spec.mesh.axes.items()}
    return spec.mesh.model_copy(update={"axes": axes, "exclude_devices": []})


@dataclasses.dataclass
class Runner:
    """A compiled step with its state and batch: each `once()` runs one step, timed."""

    step: object
    state: object
    batch: object

    def once(self) -> float:
        t0 = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))  # the whole step, its update included
        return time.perf_counter() - t0


def compile_layout(spec: Spec, n_devices: int) -> dict:
    """Compile the step on the first n devices for its abstract state (no state is made, no
    step runs): the compiled memory (the largest of the step's programs) and HLO comm the
    planner predicts."""
    mesh = build_mesh(spec, jax.devices()[:n_devices])
    step, abstract = build_abstract_job(spec, mesh)
    compiled = step.compile(abstract, _first_batch(spec, step))
    volume = step.comm_volume(compiled)  # semi_sync: the outer program's, 1/H a step
    return {
        "memory_peak_bytes": max(memory.compiled_memory(program)["memory_peak_bytes"]
                                 for program in step.programs(compiled)),
        "comm_bytes_by_kind_and_axis": volume.by_kind_and_axis(),
        "comm_ops_by_kind": volume.ops_by_kind(),
    }


def layout_runner(spec: Spec, n_devices: int) -> Runner:
    """The step on the first n devices with its initial state placed, run once."""
    mesh = build_mesh(spec, jax.devices()[:n_devices])
    step, _ = build_abstract_job(spec, mesh)
    treedef = jax.tree.structure(step.state_shardings)
    state = jax.device_put(jax.tree.unflatten(treedef, _host_state(spec)), step.state_shardings)
    runner = Runner(step, state, _first_batch(spec, step))
    runner.once()  # compiles; one-off work (allocations, threads) stays out of the timings
    return runner


def _first_batch(spec: Spec, step):
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    return step.shard_batch(data.batch(0))


def collective_rows(sizes=(16 << 10, 256 << 10, 1 << 20, 4 << 20)) -> list[dict]:
    """`trainspec bench collectives --json` rows of the xla all_reduce over all devices."""
    from trainspec.jax.tools import collectives_bench as bench, collectives_report as report

    return [report.as_dict(r) for r in bench.sweep(["all_reduce"], ["float32"], ["xla"],
                                                   list(sizes), "sum", 10, 3)]


def update_bandwidth(elements: int = 1 << 18, repeats: int = 20) -> float:
    """The host's memory bandwidth as the optimizer update sees it (bytes/s): an AdamW-like
    elementwise update of `elements` float32 per device (read parameter, gradient and two
    moments, write parameter and moments) on every device at once, median of `repeats`."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def update(p, g, m, v):
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        return p - 1e-3 * (m / (jnp.sqrt(v) + 1e-8) + 0.01 * p), m, v

    devices = jax.devices()
    sharding = NamedSharding(Mesh(devices, ("d",)), P("d"))
    p, g, m, v = (jax.device_put(jnp.ones((len(devices) * elements,), jnp.float32), sharding)
                  for _ in range(4))
    step = jax.jit(update, donate_argnums=(0, 2, 3))
    times = []
    for _ in range(repeats + 1):  # the first compiles
        t0 = time.perf_counter()
        p, m, v = jax.block_until_ready(step(p, g, m, v))
        times.append(time.perf_counter() - t0)
    return len(devices) * 7 * elements * 4 / statistics.median(times[1:])


def calibrate_cpu(profile: Profile, bench_rows: list[dict] | None = None,
                  peak: float | None = None) -> Profile:
    """The CPU profile with this machine's measured peak, links and memory bandwidth."""
    calibrated = calibrate(profile, bench_rows if bench_rows is not None else collective_rows(),
                           peak if peak is not None else matmul_peak())
    return dataclasses.replace(calibrated, memory_bandwidth_Bps=update_bandwidth())


def fit_compute(profile: Profile, points) -> Profile:
    """The achievable fraction and the per-step overhead that make measured steps come out
    right: `points` are (prediction, measured seconds) of one device at two or more batch
    sizes (different work, the same program), solved by least squares for
    measured - comm - update = compute x (fraction / fitted fraction) + overhead."""
    xs = [p.compute_s for p, _ in points]
    ys = [m - p.comm_s["exposed"] - p.update_s for p, m in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    overhead = max(my - slope * mx, 0.0)
    if overhead == 0.0 or slope <= 0:  # noise made the intercept or the slope negative:
        overhead, slope = 0.0, sum(ys) / sum(xs)  # all of it is compute
    return dataclasses.replace(profile, achievable_fraction=profile.achievable_fraction / slope,
                               program_overhead_s=overhead)


def _with_peer_latency(profile: Profile, seconds: float) -> Profile:
    return dataclasses.replace(profile, ici=dataclasses.replace(profile.ici, alpha_per_peer_s=seconds))


def fit_collective_latency(profile: Profile, spec: Spec, n_devices: int, measured_s: float) -> Profile:
    """The ICI latency each peer in a group adds, from one measured multi-device step: the
    rest of the prediction held, solved for the step's sum of collective operations x peers."""
    base = predict_for(spec, n_devices, _with_peer_latency(profile, 0.0)).step_time_s
    per_second = predict_for(spec, n_devices, _with_peer_latency(profile, 1.0)).step_time_s - base
    return _with_peer_latency(profile, max((measured_s - base) / per_second, 0.0))


def step_time(runner: Runner, steps: int = 11) -> float:
    """The median of `steps` timed steps."""
    return statistics.median(runner.once() for _ in range(steps))


def interleaved_step_times(runners: list[Runner], rounds: int = 15) -> list[float]:
    """Each runner's median step time over `rounds` rounds of one step each, in turn, so that
    a change of the machine's load during the measurement falls on all of them alike."""
    times = [[] for _ in runners]
    for _ in range(rounds):
        for t, runner in zip(times, runners):
            t.append(runner.once())
    return [statistics.median(t) for t in times]


# (data, fsdp, tensor, dcn, rows) of the steps the time calibration measures: the 1-device
# step at two batch sizes (achievable fraction, per-step overhead) and the 8-device tensor
# layout, the most collective operations on the largest group (latency per peer)
TIME_CALIBRATION = ((1, 1, 1, 1, 8), (1, 1, 1, 1, 24), (1, 1, 8, 1, 8))


def calibrate_time(profile: Profile, runner_for) -> Profile:
    """`profile` with the step-time parameters fitted to the `TIME_CALIBRATION` steps, timed
    interleaved; `runner_for(data, fsdp, tensor, dcn, rows)` gives each one's Runner."""
    return fit_time(profile, interleaved_step_times([runner_for(*c) for c in TIME_CALIBRATION]))


def fit_time(profile: Profile, seconds: list[float]) -> Profile:
    """`profile` with the step-time parameters fitted to the measured `TIME_CALIBRATION`
    steps (`seconds`, in that order). One multi-device step fits one latency parameter: the
    per-peer one, the ICI alpha set to 0. The validation's 2 x 4 row runs its DCN stage
    in-process, so its DCN link is this ICI link."""
    (one, three, tensor8), (t_one, t_three, t_tensor8) = TIME_CALIBRATION, seconds
    # the collective bench's intercept is the dispatch of one jitted collective per call,
    # which a collective inside the step does not pay: in the step, the latency is the peers'
    profile = dataclasses.replace(profile, ici=dataclasses.replace(profile.ici, alpha_s=0.0))
    fitted = fit_compute(profile, [(predict_for(validation_spec(*one), 1, profile), t_one),
                                   (predict_for(validation_spec(*three), 1, profile), t_three)])
    fitted = fit_collective_latency(fitted, validation_spec(*tensor8), math.prod(tensor8[:3]), t_tensor8)
    return dataclasses.replace(fitted, dcn=fitted.ici)
