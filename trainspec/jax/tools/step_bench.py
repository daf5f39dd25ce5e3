"""`trainspec bench step`: several specs of the same model, timed interleaved, side by side.

Every spec is built and compiled first, then warmed up; the timed steps run in rounds, each
round giving every spec a few steps in turn, so that a machine whose speed drifts (other
processes, thermal limits) affects all specs alike. Step time is the median of the rounds.
"""
from __future__ import annotations

import statistics
import time

import jax

from trainspec.core.errors import UserInputError
from trainspec.core import flops
from trainspec.jax.metrics.logger import analyze_step
from trainspec.core.transformer_flops import for_spec as model_flops
from trainspec.jax.feed import local_rows
from trainspec.jax.train import build_job

METRICS = [  # (key, label, scale, format) for the side-by-side table
    ("step_time_s", "step time (ms)", 1e3, "{:.2f}"),
    ("tokens_per_s", "tokens/s", 1, "{:.0f}"),
    ("mfu", "MFU (%)", 100, "{:.3f}"),
    ("hfu", "HFU (%)", 100, "{:.3f}"),
    ("memory_peak_bytes", "peak memory/device (MiB)", 2**-20, "{:.2f}"),
    ("comm_bytes_per_step", "comm/step/device (MiB)", 2**-20, "{:.3f}"),
    ("comm_bus_bytes_per_step", "bus bytes/step/device (MiB)", 2**-20, "{:.3f}"),
    ("compile_time_s", "compile (s)", 1, "{:.2f}"),
    ("final_loss", "loss after the run", 1, "{:.4f}"),
]


def bench(specs: list[tuple[str, object]], steps: int, warmup: int = 2, rounds: int = 5):
    """Results per spec label: timings of `steps` steps after `warmup`, and the static metrics."""
    models = {label: spec.model for label, spec in specs}
    if len({m.model_dump_json() for m in models.values()}) > 1:
        raise UserInputError("bench step compares layouts of one model: the [model] sections of "
                             + ", ".join(models) + " differ")
    rounds = max(1, min(rounds, steps))
    per_round = [steps // rounds + (i < steps % rounds) for i in range(rounds)]
    jobs = {}
    for label, spec in specs:
        job = build_job(spec, total_steps=warmup + steps)
        rows = local_rows(job.step)
        analysis = analyze_step(job.step, job.state, job.data.batch(0, rows),
                                model_flops(spec))
        jobs[label] = {"job": job, "rows": rows, "state": job.state, "next": 0,
                       "analysis": analysis, "times": [], "spec": spec}

    def advance(entry, n):
        job, metrics = entry["job"], None
        for _ in range(n):
            batch = job.data.batch(entry["next"], entry["rows"])
            entry["state"], metrics = job.step(entry["state"], batch)
            entry["next"] += 1
        return metrics

    for entry in jobs.values():
        jax.block_until_ready(advance(entry, warmup))
    for n in per_round:
        for entry in jobs.values():
            t = time.perf_counter()
            metrics = advance(entry, n)
            jax.block_until_ready(metrics)
            entry["times"].append((time.perf_counter() - t) / n)
            entry["loss"] = entry["job"].step.host_metrics(metrics)["loss"]

    results = {}
    for label, entry in jobs.items():
        fields = entry["analysis"].fields
        step_time = statistics.median(entry["times"])
        peak = flops.Peak(fields["peak_flops_per_device"], fields["peak_flops_source"])
        results[label] = {
            "step_time_s": step_time,
            "step_times_s": entry["times"],
            "tokens_per_s": flops.tokens_per_step(entry["spec"]) / step_time,
            "mfu": flops.utilisation(fields["model_flops_per_step"], step_time, fields["n_devices"], peak),
            "hfu": flops.utilisation(fields["hardware_flops_per_step"], step_time, fields["n_devices"], peak),
            "final_loss": float(entry["loss"]),
            "mesh": entry["job"].mesh_shape,
            "steps": steps, "warmup": warmup, "rounds": rounds,
            **{k: v for k, v in fields.items()},
        }
    return results


def table(results: dict[str, dict]) -> str:
    labels = list(results)
    base = results[labels[0]]
    headers = ["metric"] + labels + [f"{lab} / {labels[0]}" for lab in labels[1:]]
    rows = []
    for key, name, scale, fmt in METRICS:
        cells = [fmt.format(r[key] * scale) if r.get(key) is not None else "-" for r in results.values()]
        ratios = [f"{results[lab][key] / base[key]:.3f}x" if results[lab].get(key) and base.get(key)
                  else "-" for lab in labels[1:]]
        rows.append([name] + cells + ratios)
    rows.append(["mesh"] + [" x ".join(f"{a}={s}" for a, s in r["mesh"].items())
                            for r in results.values()] + ["" for _ in labels[1:]])
    widths = [max(len(r[i]) for r in rows + [headers]) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])
