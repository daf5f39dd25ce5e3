"""`trainspec validate FILE`: check a spec, print the resolved mesh and the parameter layout of
the reference model, or of yours (`--model MODULE:FN`, as `trainspec train --model`)."""
from __future__ import annotations

from pathlib import Path

from trainspec.cli.devices import ensure_host_devices
from trainspec.cli.options import add_host_devices, add_overrides


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="check a spec and show its mesh and layout")
    p.add_argument("spec", type=Path, help="spec file (TOML)")
    p.add_argument("--model", metavar="MODULE:FN",
                   help="show the layout of your model (FN(spec) returns a UserModel, "
                   "docs/wrapping.md) instead of the reference model's")
    add_overrides(p)
    add_host_devices(p)
    p.set_defaults(func=run)


def run(args) -> int:
    ensure_host_devices(args.host_devices)
    import jax

    from trainspec.core import user_model
    from trainspec.core.spec import load_spec
    from trainspec.jax import layout
    from trainspec.jax.train import build_abstract_job, user_job

    spec = load_spec(args.spec, args.overrides)
    if args.model:
        run_step, abstract_state, _, _ = user_job(spec, user_model.load(args.model, spec))
        step = run_step.wrapped
    else:
        step, abstract_state = build_abstract_job(spec)
    print(f"spec {args.spec}: valid (spec_version {spec.spec_version})")
    print(f"devices: {jax.device_count()} ({jax.devices()[0].platform})")
    print("mesh: " + " x ".join(f"{k}={v}" for k, v in step.mesh.shape.items()))
    print(f"batch: global {spec.batch.global_batch}, micro {spec.batch.micro}, "
          f"{spec.batch.accumulation_steps} accumulation steps, sharded "
          f"{layout.batch_partition_spec(spec, step.mesh, 2)}")
    print("logical rules: " + ", ".join(f"{k}->{list(v)}" for k, v in layout.logical_rules(spec).items()))
    print("layout (path, shape, partition spec):")
    for line in layout.describe(step.state_pspecs, abstract_state):
        print("  " + line)
    return 0
