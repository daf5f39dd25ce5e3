"""`trainspec validate FILE`: check a spec, print the resolved mesh and the parameter layout of
the reference model, or of yours (`--model MODULE:FN`, as `trainspec train --model`), on the
implementation that would train it (`--framework`)."""
from __future__ import annotations

from pathlib import Path

from trainspec.cli.devices import ensure_host_devices
from trainspec.cli.options import add_host_devices, add_overrides, at_least


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="check a spec and show its mesh and layout")
    p.add_argument("spec", type=Path, help="spec file (TOML)")
    p.add_argument("--model", metavar="MODULE:FN",
                   help="show the layout of your model (FN(spec) returns a UserModel, "
                   "docs/wrapping.md) instead of the reference model's")
    p.add_argument("--framework", choices=("jax", "torch"), default="jax",
                   help="the implementation whose layout to show (default jax)")
    p.add_argument("--nprocs", type=at_least(1),
                   help="torch: the ranks the job would have (default as `trainspec train "
                   "--framework torch`: 4 on CPU, one per GPU)")
    add_overrides(p)
    add_host_devices(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from trainspec.core import user_model
    from trainspec.core.errors import UserInputError

    if args.framework == "torch" and args.host_devices is not None:
        raise UserInputError("--host-devices: a JAX flag; torch runs one device per rank "
                             "(set the ranks with --nprocs)")
    if args.framework == "jax" and args.nprocs is not None:
        raise UserInputError("--nprocs: only with --framework torch")
    from trainspec.core.spec import load_spec

    spec = load_spec(args.spec, args.overrides)
    model = user_model.load(args.model, spec) if args.model else None
    if args.framework == "torch":
        return _torch(args, spec, model)
    return _jax(args, spec, model)


def _jax(args, spec, model) -> int:
    ensure_host_devices(args.host_devices)
    import jax

    from trainspec.jax import layout
    from trainspec.jax.train import build_abstract_job, user_job

    if model is not None:
        from trainspec.jax.user_model_check import check_init

        check_init(model, spec.seed)
        run_step, abstract_state, _, _ = user_job(spec, model)
        step = run_step.wrapped
    else:
        step, abstract_state = build_abstract_job(spec)
    _valid(args, spec)
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


def _torch(args, spec, model) -> int:
    """Worked out on this process, no ranks started: the parameters are built on torch's meta
    device (shapes only, nothing allocated), as the ranks would build them."""
    import torch

    from trainspec.cli.train_torch import default_ranks
    from trainspec.torch import describe
    from trainspec.torch.support import batch_axes, check_layout, check_run

    world = args.nprocs or default_ranks()
    check_run(spec, world, own_model=model is not None)
    if model is not None:
        from trainspec.torch.user_model_check import check_init

        check_init(model)
    dims = check_layout(spec, world)
    with torch.device("meta"):
        if model is None:
            from trainspec.torch.model import Transformer

            built, units = Transformer(spec.model), ("blocks.*",)
        else:
            built, units = model.init(), model.fsdp_units
    layout = describe.parameter_layout(dims, built, units, model and model.tensor_plan)
    _valid(args, spec)
    print(f"ranks: {world} (torch)")
    print("mesh: " + " x ".join(f"{k}={v}" for k, v in dims.shape.items()))
    print(f"batch: global {spec.batch.global_batch}, micro {spec.batch.micro}, "
          f"{spec.batch.accumulation_steps} accumulation steps, rows split over "
          f"{' x '.join(batch_axes(dims)) or 'nothing (every rank the whole batch)'}")
    print("layout (parameter, shape, split, rank 0's block):")
    for line in describe.describe(layout):
        print("  " + line)
    return 0


def _valid(args, spec) -> None:
    print(f"spec {args.spec}: valid (spec_version {spec.spec_version})")
