"""`trainspec export RUN --to safetensors [--out DIR]`: a reference-model run's trained weights
as a Hugging Face style directory (trainspec/core/export.py), from its newest good checkpoint,
read by the backend that wrote it (found through the registry)."""
from __future__ import annotations

from pathlib import Path

from trainspec.core.errors import UserInputError

FORMATS = ("safetensors",)


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="a run's trained weights as safetensors "
                              "(Hugging Face style: model.safetensors + config.json)")
    p.add_argument("run", type=Path, help="the run directory")
    p.add_argument("--to", default="safetensors", metavar="FORMAT",
                   help="the format: safetensors (the only one)")
    p.add_argument("--out", type=Path, help="the directory to write (default: RUN/export)")
    p.set_defaults(func=run)


def run(args) -> int:
    from trainspec.core import export, registry
    from trainspec.core.run_files import checkpoint_framework, saved_spec
    from trainspec.core.spec import load_spec

    if args.to not in FORMATS:
        raise UserInputError(f"--to {args.to}: not a format; one of {', '.join(FORMATS)}")
    spec_file = saved_spec(args.run)
    if spec_file is None:
        raise UserInputError(f"export: {args.run} is not a run directory (no spec.toml)")
    spec = load_spec(spec_file)
    if spec.model.moe is not None:
        raise UserInputError("export: model.moe: the export layout holds the dense reference "
                             "model only")
    framework = checkpoint_framework(args.run / spec.checkpoint.dir)
    trained = None if framework is None else \
        registry.backend(framework).trained_params(spec, args.run)
    if trained is None:
        raise UserInputError(f"export: {args.run} holds no checkpoint to export (train it with "
                             "checkpoint.interval > 0)")
    params, step = trained
    out = export.write(args.out or args.run / "export", params, spec.model, step)
    print(f"exported step {step} of {args.run} ({framework}): {out / export.WEIGHTS}, "
          f"{out / export.CONFIG}")
    return 0
