"""`trainspec advise RUN_DIR_or_JSONL [--spec S] [--plot PNG] [--json PATH]`."""
from __future__ import annotations

from pathlib import Path

from trainspec.cli.options import add_outputs


def register(subparsers) -> None:
    p = subparsers.add_parser("advise", help="critical batch and batch-size advice from a run's GNS")
    p.add_argument("run", type=Path, help="run directory or its metrics JSONL")
    p.add_argument("--spec", type=Path, help="the run's spec (default: the one the run directory "
                   "was trained under, RUN_DIR/spec.toml, else the built-in spec)")
    add_outputs(p, json="write the advice as JSON",
                plot="write a PNG: GNS over steps and the trade-off")
    p.set_defaults(func=run)


def run_spec(run: Path, spec_path: Path | None):
    """The spec a run was trained with: --spec, the run directory's saved spec (either
    framework writes it; a metrics file's directory is its run's), or the default."""
    from trainspec.core.spec import default_spec, load_spec
    from trainspec.core.run_files import saved_spec

    if spec_path is None:
        spec_path = saved_spec(run if Path(run).is_dir() else Path(run).parent)
    return default_spec() if spec_path is None else load_spec(spec_path)


def run(args) -> int:
    from trainspec.core import advice
    from trainspec.report.advice_plots import plot_advice

    result = advice.advise(args.run, run_spec(args.run, args.spec))
    print(advice.text(result))
    if args.plot:
        print(f"plot: {plot_advice(result, args.plot)}")
    if args.json:
        advice.write_json(result, args.json)
        print(f"json: {args.json}")
    return 0
