"""`trainspec sweep --out DIR --widths 32,64 --depths 1,2 --tokens 100000,200000`."""
from __future__ import annotations

import argparse
from pathlib import Path

from trainspec.jax.devices import ensure_host_devices
from trainspec.cli.options import add_host_devices, add_overrides, ascii_number, integer


def _ints(text: str) -> list[int]:
    try:
        return [int(ascii_number(float, x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 32,64, got {text!r}") from None


def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="a grid of small reference-model runs for scaling fits")
    p.add_argument("--out", type=Path, required=True, help="directory of the grid's run dirs")
    p.add_argument("--widths", type=_ints, required=True, help="d_model values, e.g. 32,64")
    p.add_argument("--depths", type=_ints, default=[2], help="n_layers values (default 2)")
    p.add_argument("--tokens", type=_ints, required=True,
                   help="token budgets per run, e.g. 1e5,2e5 (steps = tokens / batch tokens)")
    p.add_argument("--spec", type=Path, help="base spec (default: the built-in spec)")
    add_overrides(p, help="override a base spec field (repeatable)")
    p.add_argument("--eval-batches", type=integer, default=4, help="held-out batches per run")
    add_host_devices(p)
    p.set_defaults(func=run)


def run(args) -> int:
    ensure_host_devices(args.host_devices)
    from trainspec.core.errors import UserInputError
    from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
    from trainspec.jax.tools.sweep import sweep

    if args.eval_batches < 1:
        raise UserInputError(f"--eval-batches: expected a positive integer, got {args.eval_batches}")
    base = load_spec(args.spec or DEFAULT_SPEC_PATH, args.overrides)
    sweep(base, args.out, args.widths, args.depths, args.tokens, args.eval_batches)
    print(f"sweep: {args.out} (fit it with `trainspec scaling {args.out}`)")
    return 0
