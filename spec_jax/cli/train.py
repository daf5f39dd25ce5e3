"""`trainspec train`: the default job (or any spec) with a progress bar, metrics and a summary."""
from __future__ import annotations

import argparse
from pathlib import Path

from spec_jax.cli.devices import ensure_host_devices


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the reference model under a spec")
    p.add_argument("--spec", type=Path, help="spec file (TOML); default: the built-in spec")
    p.add_argument("--steps", type=_positive_int, help="optimizer steps (default: train.steps)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/default"), help="output directory")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
        help="override one spec field (repeatable), e.g. --set mesh.axes.fsdp.size=2",
    )
    p.add_argument("--summary-json", type=Path, help="also write the summary to this JSON file")
    p.add_argument("--host-devices", type=_positive_int,
                   help="CPU devices to present (default 8, or as XLA_FLAGS says)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def run(args) -> int:
    ensure_host_devices(args.host_devices)
    from spec_jax.spec import DEFAULT_SPEC_PATH, load_spec
    from spec_jax.train import run as train

    spec_path = args.spec or DEFAULT_SPEC_PATH
    spec = load_spec(Path(spec_path), args.overrides)
    summary = train(
        spec,
        args.run_dir,
        steps=args.steps,
        spec_label=str(spec_path),
        progress=not args.quiet,
        summary_json=args.summary_json,
    )
    _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    mesh = " x ".join(f"{k}={v}" for k, v in summary["mesh"].items())
    print(
        f"\ntrained {summary['steps']} steps on mesh {mesh} "
        f"({summary['accumulation_steps']} micro-batches per step)\n"
        f"  loss           {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}\n"
        f"  tokens/s       {summary['tokens_per_s']:.0f}\n"
        f"  step time      {summary['step_time_s'] * 1e3:.1f} ms (mean, compile excluded)\n"
        f"  spec           {summary['spec']}\n"
        f"  metrics        {summary['metrics_file']}"
    )

