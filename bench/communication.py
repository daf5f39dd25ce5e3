"""The default job, synchronous vs compressed vs semi-synchronous: the table of
docs/communication.md.

    python bench/communication.py [--steps 60] [--set FIELD=VALUE ...] [--out runs/bench_comm]

Each option is one `trainspec train` run (trainspec.jax.train.run) of the default spec from seed 0,
so all see the same tokens; the synchronous run is repeated from seeds 1 and 2, and the spread
of the three final losses (init and data order both change with the seed) is the margin a
difference must exceed to mean anything. Final loss: the mean of the last `--last` steps'
recorded losses (metrics.interval = 1). Bytes: the records' `comm_bus_bytes_per_step`,
nccl-tests bus bytes per device from the compiled step's HLO (trainspec/jax/metrics/comm.py;
semi_sync amortises its outer exchange over the round). The payload count alone would rate an
all-reduce like one all-gather, though a ring all-reduce moves twice the bytes. Step time: the
summary's mean over the run's timed steps, one run each, on this machine, with the load
average printed before and after: other processes on a shared machine slow every option, so
compare times only within one table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec  # noqa: E402
from trainspec.jax.tools.communication import train_option  # noqa: E402

OPTIONS = {  # label -> overrides of the default spec
    "synchronous": [],
    "bf16": ['collectives.compression="bf16"'],
    "int8+EF": ['collectives.compression="int8"'],
    "DiLoCo H=4": ["semi_sync.inner_steps=4"],
    "DiLoCo H=16": ["semi_sync.inner_steps=16"],
    # the best outer step of docs/communication.md's sweep for a run of a few rounds
    "DiLoCo H=4 lr0.8 mu0.4": ["semi_sync.inner_steps=4", "semi_sync.outer_lr=0.8",
                               "semi_sync.outer_momentum=0.4"],
    "DiLoCo H=16 lr0.8 mu0.4": ["semi_sync.inner_steps=16", "semi_sync.outer_lr=0.8",
                                "semi_sync.outer_momentum=0.4"],
}


def load() -> str:
    """The 1-minute load average ('?' where /proc/loadavg does not exist)."""
    path = Path("/proc/loadavg")
    return path.read_text().split(" ")[0] if path.exists() else "?"


def train(label: str, overrides: list[str], seed: int, args) -> dict:
    spec = load_spec(DEFAULT_SPEC_PATH, [*args.set, f"seed={seed}", *overrides])
    run_dir = args.out / f"{label.replace(' ', '_').replace('=', '')}_seed{seed}"
    result = train_option(label, spec, run_dir, args.steps)
    return {**dataclasses.asdict(result), "final_loss": result.final_loss(args.last)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the spec's train.steps")
    parser.add_argument("--last", type=int, default=10, help="final loss: mean of the last N steps")
    parser.add_argument("--set", action="append", default=[], help="override of the default spec")
    parser.add_argument("--only", action="append", default=None, help="options to run (labels)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--out", type=Path, default=None, help="run dirs (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.out is None:  # run dirs only this run reads: removed when it ends
        work = tempfile.TemporaryDirectory(prefix="bench_comm_")
        args.out = Path(work.name)
    options = {k: v for k, v in OPTIONS.items() if args.only is None or k in args.only}
    print(f"# load average before: {load()} on {os.cpu_count()} cores; "
          f"overrides: {args.set or 'none'}", flush=True)
    rows = [train("synchronous", [], seed, args) for seed in (0, 1, 2)]
    margin = max(r["final_loss"] for r in rows) - min(r["final_loss"] for r in rows)
    for label, overrides in options.items():
        if label != "synchronous":
            rows.append(train(label, overrides, 0, args))
    print(f"# load average after: {load()}")
    sync = rows[0]
    print(f"# margin (spread of the synchronous final loss over seeds 0-2): {margin:.4f}")
    print("| option | final loss | vs synchronous | within margin | bus bytes/step | "
          "vs synchronous | step time (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in [sync, *rows[3:]]:
        gap = r["final_loss"] - sync["final_loss"]
        print(f"| {r['label']} | {r['final_loss']:.4f} | {gap:+.4f} | "
              f"{'yes' if abs(gap) <= margin else 'no'} | {r['bus_bytes']:.0f} | "
              f"{sync['bus_bytes'] / r['bus_bytes']:.2f}x | "
              f"{r['step_time_s']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"margin": margin, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
