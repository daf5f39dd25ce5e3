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

from spec_jax.core.plan.hardware import Profile, calibrate
from spec_jax.core.plan.model import Layout, fit_activation_overheads
from spec_jax.data import ByteBatches
from spec_jax.mesh import build_mesh, resolve_mesh
from spec_jax.metrics import comm, memory
from spec_jax.spec import Spec
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
    job = build_job(spec, build_mesh(spec.model_copy(update={"mesh": _single_mesh(spec)}),
                                     jax.devices()[:1]))
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


def paired_step_times(runner: Runner, reference: Runner, steps: int = 7) -> tuple[float, float]:
    """Median step times of `runner` and `reference`, their steps alternating so that both
    see the same load on a shared machine (as `trainspec bench step` alternates specs)."""
    times, ref_times = [], []
    for _ in range(steps):
        ref_times.append(reference.once())
        times.append(runner.once())
    return statistics.median(times), statistics.median(ref_times)


def matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    """Best float32 matmul FLOP/s of the process on one device (bench/cpu_matmul_peak.py's
    method at one size: the best of `repeats`, since load only ever slows a run down)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def collective_rows(sizes=(16 << 10, 256 << 10, 1 << 20, 4 << 20)) -> list[dict]:
    """`trainspec bench collectives --json` rows of the xla all_reduce over all devices."""
    from spec_jax.collectives import bench, report

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


def fit_achievable_fraction(profile: Profile, predicted_compute_s: float, predicted_comm_s: float,
                            measured_s: float) -> Profile:
    """The fraction of peak that makes one measured step (compute + comm) come out right."""
    compute = max(measured_s - predicted_comm_s, 0.1 * measured_s)
    return dataclasses.replace(profile, achievable_fraction=profile.achievable_fraction
                               * predicted_compute_s / compute)


def load_factor(reference_predicted_s: float, reference_measured_s: float) -> float:
    """How much slower the machine runs now than when it was calibrated: the reference
    layout's measured step over its prediction, from steps paired with the layout's own. On a
    CPU, compute and the in-process collectives share the same cores, so load slows both."""
    return reference_measured_s / reference_predicted_s
