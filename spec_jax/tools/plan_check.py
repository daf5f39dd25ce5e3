"""The planner against what runs here: compile and time one layout, calibrate the CPU profile.

`measure_layout` compiles the reference job's step for a spec on the first n devices and
reports what the planner predicts: per-device memory (`compiled.memory_analysis()`), HLO
communication bytes by kind and mesh axis (spec_jax.metrics.comm) and the median step time.
`calibrate_cpu` measures this machine's matmul peak and collective alpha-beta and fits the
activation overheads, so that `trainspec plan --hardware cpu` predicts this machine.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from spec_jax.core.data import ByteBatches
from spec_jax.core.mesh import resolve_mesh
from spec_jax.core.plan.hardware import Profile, calibrate
from spec_jax.core.plan.model import Layout, fit_activation_overheads
from spec_jax.core.spec import Spec
from spec_jax.mesh import build_mesh
from spec_jax.metrics import comm, memory
from spec_jax.metrics.cpu_peak import matmul_peak
from spec_jax.train import build_abstract_job, build_job


def layout_of(spec: Spec, n_devices: int) -> Layout:
    resolved = resolve_mesh(spec, n_devices)
    return Layout(dict(zip(resolved.names, resolved.sizes)), dict(zip(resolved.names, resolved.dcn)))


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
        jax.block_until_ready(metrics)
        return time.perf_counter() - t0


def compile_layout(spec: Spec, n_devices: int) -> tuple[Runner, dict]:
    """Compile the step on the first n devices: (runner, compiled memory and HLO comm)."""
    mesh = build_mesh(spec, jax.devices()[:n_devices])
    step, _ = build_abstract_job(spec, mesh)
    treedef = jax.tree.structure(step.state_shardings)
    state = jax.device_put(jax.tree.unflatten(treedef, _host_state(spec)), step.state_shardings)
    batch = step.shard_batch(ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed).batch(0))
    compiled = step.compile(state, batch)
    runner = Runner(step, state, batch)
    runner.once()  # one-off work (allocations, thread start-up) stays out of the timings
    return runner, {
        "memory_peak_bytes": memory.compiled_memory(compiled)["memory_peak_bytes"],
        "comm_bytes_by_kind_and_axis": comm.analyze_compiled(compiled, mesh).by_kind_and_axis(),
    }


class ComputeProbe:
    """A fixed matmul workload on each of the first n devices (one program, all at once): how
    fast the machine runs n device threads right now, to pair with a layout's steps."""

    def __init__(self, n_devices: int, size: int = 256, repeats: int = 16):
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        mesh = Mesh(jax.devices()[:n_devices], ("d",))

        def work(a):
            return jax.lax.fori_loop(0, repeats, lambda _, x: jnp.tanh(x @ a), a)

        self.x = jax.device_put(jnp.ones((n_devices * size, size), jnp.float32) / size,
                                NamedSharding(mesh, P("d")))
        self.fn = jax.jit(jax.shard_map(work, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        self.once()

    def once(self) -> float:
        t0 = time.perf_counter()
        self.fn(self.x).block_until_ready()
        return time.perf_counter() - t0


def paired_step_times(runner, reference, steps: int = 11) -> list[tuple[float, float]]:
    """(step time, reference time) pairs, the two alternating, so that both of a pair see the
    same load on a shared machine (as `trainspec bench step` alternates specs)."""
    pairs = []
    for _ in range(steps):
        ref = reference.once()
        pairs.append((runner.once(), ref))
    return pairs


def collective_rows(sizes=(16 << 10, 256 << 10, 1 << 20, 4 << 20)) -> list[dict]:
    """`trainspec bench collectives --json` rows of the xla all_reduce over all devices."""
    from spec_jax.tools import collectives_bench as bench, collectives_report as report

    return [report.as_dict(r) for r in bench.sweep(["all_reduce"], ["float32"], ["xla"],
                                                   list(sizes), "sum", 10, 3)]


def calibrate_cpu(profile: Profile, memory_points: list[tuple[Spec, int, float]] | None = None,
                  bench_rows: list[dict] | None = None, peak: float | None = None) -> Profile:
    """The CPU profile with this machine's measured peak and links, and (given compiled
    memory of two or more layouts with different tensor sizes) its activation overheads."""
    calibrated = calibrate(profile, bench_rows if bench_rows is not None else collective_rows(),
                           peak if peak is not None else matmul_peak())
    if memory_points:
        calibrated = fit_activation_overheads(
            [(s, layout_of(s, n), measured) for s, n, measured in memory_points], calibrated)
    return calibrated


def fit_compute(profile: Profile, points) -> Profile:
    """The achievable fraction and the per-program overhead that make measured steps come out
    right: `points` are (prediction, measured seconds) of one device at two or more batch
    sizes (different work, the same program), solved by least squares for
    measured - comm = compute x (fraction / fitted fraction) + overhead."""
    xs = [p.compute_s for p, _ in points]
    ys = [m - p.comm_s["exposed"] for p, m in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    overhead = max(my - slope * mx, 0.0)
    if overhead == 0.0:  # noise made the intercept negative: all of it is compute
        slope = sum(ys) / sum(xs)
    return dataclasses.replace(profile, achievable_fraction=profile.achievable_fraction / slope,
                               program_overhead_s=overhead)


def load_factors(profile: Profile, n_devices: int, probe_times, calibration_probe_s: float) -> list[float]:
    """How much slower n device threads run now than the profile assumes, per probe run: the
    compute probe on those devices over what the profile expects from the 1-device probe
    timed at calibration (the same per-device work at the profile's share of the host for n
    devices). On a CPU, load slows compute and in-process collectives alike."""
    expected = calibration_probe_s * profile.device_flops("float32", 1) / profile.device_flops("float32", n_devices)
    return [t / expected for t in probe_times]
