"""`trainspec validate FILE`: check a spec, print the resolved mesh and the parameter layout of
the reference model, or of yours (`--model MODULE:FN`, as `trainspec train --model`), on the
backend that would train it (`--framework`)."""
from __future__ import annotations

from pathlib import Path

from trainspec.cli.options import add_framework, add_host_devices, add_overrides, at_least


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="check a spec and show its mesh and layout")
    p.add_argument("spec", type=Path, help="spec file (TOML)")
    p.add_argument("--model", metavar="MODULE:FN",
                   help="show the layout of your model (FN(spec) returns a UserModel, "
                   "docs/wrapping.md) instead of the reference model's")
    add_framework(p, "the backend whose layout to show")
    p.add_argument("--nprocs", type=at_least(1),
                   help="the ranks the job would have, for a backend that starts its own "
                   "(default as `trainspec train`: torch 4 on CPU, one per GPU)")
    add_overrides(p)
    add_host_devices(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from trainspec.core import registry, user_model
    from trainspec.core.sinks import check_sinks
    from trainspec.core.spec import load_spec

    backend = registry.backend(args.framework)
    backend.capabilities.check_flags({"--nprocs": args.nprocs,
                                      "--host-devices": args.host_devices})
    backend.present_devices(args.host_devices)
    spec = load_spec(args.spec, args.overrides)
    check_sinks(spec)  # what train would refuse
    model = user_model.load(args.model, spec) if args.model else None
    spec = user_model.spec_for(spec, model)
    lines = backend.describe(spec, model, args.nprocs)  # refuses the spec before it is "valid"
    print(f"spec {args.spec}: valid (spec_version {spec.spec_version})")
    print("\n".join(lines))
    return 0
