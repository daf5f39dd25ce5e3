"""`trainspec bench <what>`: benchmarks. `bench collectives` and `bench step`; each benchmark
registers its sub-subcommand in `register`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from trainspec.jax.devices import ensure_host_devices
from trainspec.cli.options import add_host_devices, add_outputs, add_overrides, at_least, comma_list
from trainspec.core.errors import UserInputError

_SIZE_HELP = ("bytes per device, as nccl-tests: the larger of the op's input and output buffer "
              "on one device (all_gather: its output, reduce_scatter: its input); "
              "K/M/G are powers of 1024")


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (collectives, step)")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{collectives,step}")
    _register_collectives(kinds)
    _register_step(kinds)


def _register_collectives(kinds) -> None:
    p = kinds.add_parser(
        "collectives", help="nccl-tests-style sweep of the collectives, backends side by side",
        description=run_collectives.__doc__)
    p.add_argument("-b", "--min-bytes", default="4K", help=f"smallest size (default 4K); {_SIZE_HELP}")
    p.add_argument("-e", "--max-bytes", default="4M", help="largest size (default 4M)")
    p.add_argument("-f", "--step-factor", type=at_least(2), default=4, help="size multiplier (default 4)")
    p.add_argument("--ops", type=comma_list, default=["all_reduce"],
                   help="comma-separated: all_reduce,reduce_scatter,all_gather,all_to_all,"
                        "broadcast,permute or 'all' (default all_reduce)")
    p.add_argument("--dtypes", type=comma_list, default=["float32"],
                   help="comma-separated: float32,bfloat16,float16,float64,int32 (default float32)")
    p.add_argument("--backends", type=comma_list, default=["xla", "ext"], help="default xla,ext")
    p.add_argument("-o", "--redop", default="sum",
                   help="reduction of all_reduce (sum, mean, max, min) and reduce_scatter "
                        "(sum, mean; others fall back to sum); default sum")
    p.add_argument("-n", "--iters", type=at_least(1), default=20, help="timed calls per size (default 20)")
    p.add_argument("-w", "--warmup", type=at_least(0), default=5, help="untimed calls first (default 5)")
    p.add_argument("--in-place", action="store_true",
                   help="all_reduce only: also measure each backend in place, as nccl-tests' "
                        "in-place column (the result takes the input's buffer)")
    add_host_devices(p, minimum=2)
    add_outputs(p, json="write the rows as a JSON list to this file",
                plot="write a PNG of busbw against size to this file")
    p.set_defaults(func=run_collectives)


def _choices(values, allowed, what) -> list[str]:
    if values == ["all"]:
        return list(allowed)
    unknown = [v for v in values if v not in allowed]
    if unknown or not values:
        raise UserInputError(f"{what}: unknown {', '.join(unknown) or '(empty)'}; "
                             f"choose from {', '.join(allowed)}")
    return values


def run_collectives(args) -> int:
    """Time each collective over a range of sizes for each backend; print size, count, type,
    redop, root and per backend time (us), algbw, busbw (GB/s, GB = 1e9 B, nccl-tests'
    factors) and #wrong, then each backend's time over xla's. Under `trainspec launch` every
    process measures and process 0 reports."""
    ensure_host_devices(args.host_devices)  # before anything asks jax for devices
    from trainspec.jax.runtime import initialize_from_env, is_writer

    initialize_from_env()  # under `trainspec launch`: one process of the job
    from trainspec.jax.backends import BACKENDS
    from trainspec.jax.tools import collectives_bench as bench, collectives_report as report

    sizes = bench.size_sweep(bench.parse_size(args.min_bytes, "-b/--min-bytes"),
                             bench.parse_size(args.max_bytes, "-e/--max-bytes"), args.step_factor)
    ops = _choices(args.ops, bench.OPS, "--ops")
    dtypes = _choices(args.dtypes, bench.DTYPES, "--dtypes")
    backends = _choices(args.backends, tuple(BACKENDS), "--backends")
    if args.redop not in bench.REDOPS["all_reduce"]:
        raise UserInputError(f"-o/--redop: unknown {args.redop!r}; choose from sum, mean, max, min")
    for backend in backends:
        BACKENDS[backend].ops()  # an unavailable backend fails now, not after an hour of xla
    if args.in_place and ops != ["all_reduce"]:
        raise UserInputError(f"--in-place: only all_reduce has an in-place form; got --ops "
                             f"{','.join(ops)}")

    writer = is_writer()  # every process measures (the ops are collective); process 0 reports
    table = report.Table(backends, args.in_place)
    if writer:
        print(table.preamble(), flush=True)
    rows = bench.sweep(ops, dtypes, backends, sizes, args.redop, args.iters, args.warmup,
                       progress=lambda row: _print(table.add(row)) if writer else None,
                       in_place=args.in_place)
    wrong = sum(r.wrong for r in rows)  # the same in every process (results fetched whole)
    if writer:
        if args.json:
            args.json.write_text(json.dumps([report.as_dict(r) for r in rows], indent=1) + "\n")
        if args.plot:
            report.plot(rows, args.plot)
        print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        _print(table.footer(rows))
    return 0 if wrong == 0 else 1


def _print(lines):
    for line in lines:
        print(line, flush=True)
    sys.stdout.flush()


# -- bench step (trainspec.jax.tools.step_bench) ---------------------------------------------------------
def _register_step(kinds) -> None:
    p = kinds.add_parser(
        "step", help="time specs of one model interleaved, metrics side by side with ratios",
        description=run_step.__doc__)
    p.add_argument("--spec", dest="specs", type=Path, action="append", required=True,
                   help="spec file (TOML), repeatable; the first is the baseline")
    p.add_argument("--steps", type=at_least(1), default=10, help="timed steps per spec (default 10)")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed steps first (default 2)")
    add_overrides(p, help="override a field in every spec (repeatable)")
    add_host_devices(p, minimum=1)
    add_outputs(p, json="write the results as JSON to this file")
    p.set_defaults(func=run_step)


def run_step(args) -> int:
    """Build and compile each spec, warm up, then run the timed steps in rounds that alternate
    between the specs; print step time, tokens/s, MFU, memory, communication bytes and compile
    time per spec, with ratios to the first."""
    ensure_host_devices(args.host_devices)
    from trainspec.jax.tools import step_bench
    from trainspec.core.spec import load_spec

    labels = [str(p) for p in args.specs]
    if len(set(labels)) != len(labels):
        raise UserInputError("--spec: the same file is given twice")
    specs = [(label, load_spec(p, args.overrides)) for label, p in zip(labels, args.specs)]
    results = step_bench.bench(specs, args.steps, args.warmup)
    print(step_bench.table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0
