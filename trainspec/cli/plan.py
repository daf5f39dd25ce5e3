"""For a spec and a device count on a hardware profile, on paper: per-device memory (params,
optimizer, gradients, activations), communication bytes per collective and mesh axis
(ICI/DCN), FLOPs, step time (alpha-beta links + compute at the profile's achievable fraction
of peak) and MFU; all layouts ranked, or the spec's own (trainspec.core.plan; docs/plan.md).
"""
from __future__ import annotations

import json
from pathlib import Path

from trainspec.cli.options import add_outputs, add_overrides, at_least, integer, real
from trainspec.cli.summary import plural
from trainspec.core.errors import UserInputError

MODEL_FLAGS = {"layers": "model.n_layers", "d_model": "model.d_model", "heads": "model.n_heads",
               "d_ff": "model.d_ff", "vocab": "model.vocab_size", "seq_len": "batch.seq_len",
               "global_batch": "batch.global_batch", "micro_batch": "batch.micro_batch"}
PLOT_COUNTS = (8, 64, 512, 4096, 32768, 100000)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="predict memory, communication and step time per layout, on paper",
        description=__doc__)
    p.add_argument("--spec", type=Path, help="spec file (default: the default spec)")
    add_overrides(p)
    p.add_argument("--devices", type=integer, help="device count (required, except with "
                   "--published)")
    p.add_argument("--hardware", help="profile name or .toml file (default cpu; with --published "
                   "the hardware it ran on)")
    p.add_argument("--published", metavar="NAME",
                   help="a published model in the layout it was trained with (llama3-405b-8k, "
                   "llama3-405b-128k, deepseek-v3, mixtral-8x7b), by the planner of published "
                   "architectures (docs/plan.md)")
    p.add_argument("--devices-per-host", type=at_least(1),
                   help="devices in one ICI domain (default: the profile's)")
    p.add_argument("--all-layouts", action="store_true",
                   help="rank every pipeline x data x fsdp x tensor factorisation (default: the "
                   "spec's mesh)")
    p.add_argument("--params", type=real, metavar="N",
                   help="a transformer of about N parameters (e.g. 1.3e9): layers, width, heads "
                   "and d_ff from the shape rule of docs/plan.md; not with --layers/--d-model/"
                   "--heads/--d-ff")
    for flag, field in MODEL_FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", type=integer, help=f"sets {field}")
    p.add_argument("--calibrate", type=Path, metavar="BENCH_JSON",
                   help="fit the ICI link to `trainspec bench collectives --json` rows")
    p.add_argument("--peak-flops", type=real, help="measured matmul peak FLOP/s (all dtypes)")
    p.add_argument("--top", type=at_least(1), default=10, help="rows of the ranked table (default 10)")
    add_outputs(p, json="write all predictions as JSON",
                plot="PNG: best step time and memory vs device count "
                     f"({PLOT_COUNTS[0]}..{PLOT_COUNTS[-1]}, per-device batch held)")
    p.set_defaults(func=run)


SHAPE_FLAGS = ("layers", "d_model", "heads", "d_ff")  # what --params decides


def _spec(args):
    from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec

    sets = [f"{MODEL_FLAGS[f]}={getattr(args, f)}" for f in MODEL_FLAGS if getattr(args, f) is not None]
    if args.global_batch is not None and args.micro_batch is None:
        sets.append(f"batch.micro_batch={args.global_batch}")
    spec = load_spec(args.spec or DEFAULT_SPEC_PATH, [*args.overrides, *sets])
    return spec if args.params is None else _sized(spec, args)


def _sized(spec, args):
    """The spec with the model of --params (its vocabulary kept)."""
    from trainspec.core.plan.transformer import shape_for_params
    from trainspec.core.spec import load_spec

    given = [f"--{f.replace('_', '-')}" for f in SHAPE_FLAGS if getattr(args, f) is not None]
    if given:
        raise UserInputError(f"--params picks the model's shape; it cannot be combined with {', '.join(given)}")
    try:
        m = shape_for_params(args.params, spec.model)
    except ValueError as e:
        raise UserInputError(f"--params: {e}") from None
    return load_spec(spec, [f"model.n_layers={m.n_layers}", f"model.d_model={m.d_model}",
                            f"model.n_heads={m.n_heads}", f"model.d_ff={m.d_ff}"])


def _profile(args):
    import dataclasses

    from trainspec.core.plan.hardware import calibrate, load_profile

    profile = load_profile(args.hardware or "cpu")
    if args.devices_per_host:
        profile = dataclasses.replace(profile, devices_per_host=args.devices_per_host,
                                      ici_domain_devices=None)
    rows = bench_rows(args.calibrate) if args.calibrate else None
    return calibrate(profile, rows, args.peak_flops)


BENCH_ROW_NUMBERS = ("size_bytes", "time_us", "algbw_gbps", "busbw_gbps")


def bench_rows(path: Path) -> list[dict]:
    """The rows of a `trainspec bench collectives --json` file; UserInputError naming
    --calibrate for anything else."""
    expected = "expected the JSON list that `trainspec bench collectives --json` writes"
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise UserInputError(f"--calibrate {path}: cannot read it ({err.strerror})") from None
    except (UnicodeDecodeError, ValueError):
        raise UserInputError(f"--calibrate {path}: not JSON; {expected}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UserInputError(f"--calibrate {path}: not a list of rows; {expected}")
    for i, row in enumerate(rows):
        for key in BENCH_ROW_NUMBERS:
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise UserInputError(f"--calibrate {path}: row {i} has no positive number "
                                     f"{key!r}; {expected}")
    return rows


def predictor(profile):
    from trainspec.core.plan.model import predict
    from trainspec.core.transformer_flops import for_spec

    def run(spec, layout):
        f = for_spec(spec)
        return predict(spec, layout, profile, f.model_per_token(spec.metrics.flops_convention),
                       f.hardware_per_token())
    return run


def run(args) -> int:
    from trainspec.core.plan import search

    if args.published is not None:
        from trainspec.cli import plan_published
        flags = ("spec", "devices", "devices_per_host", "all_layouts", "params", *MODEL_FLAGS,
                 "calibrate", "peak_flops", "plot")
        given = [f"--{f.replace('_', '-')}" for f in flags if getattr(args, f) not in (None, False)]
        return plan_published.run(args, given + (["--set"] if args.overrides else []))
    if args.devices is None:
        raise UserInputError("--devices is required (or --published NAME)")
    if args.devices < 1:
        raise UserInputError(f"--devices must be at least 1, got {args.devices}")
    if args.peak_flops is not None and not 0 < args.peak_flops < float("inf"):
        raise UserInputError(f"--peak-flops must be a positive FLOP/s, got {args.peak_flops}")
    spec, profile = _spec(args), _profile(args)
    predict = predictor(profile)
    if args.all_layouts:
        spec = search.with_pipeline_axis(spec)
        layouts = search.all_layouts(spec, args.devices, profile.ici_domain)
    else:
        layouts = [search.spec_layout(spec, args.devices, profile.ici_domain)]
    preds = search.ranked([predict(spec, lay) for lay in layouts])
    print(table(preds[: args.top], profile, spec))
    if args.json:
        args.json.write_text(json.dumps({"hardware": profile.as_dict(), "spec": spec.to_dict(),
                                         "predictions": [p.as_dict() for p in preds]}, indent=1) + "\n")
    if args.plot:
        plot(spec, profile, predict, args.plot, args.devices)
    if not any(p.fits for p in preds):
        raise UserInputError(f"no layout fits: {preds[0].reasons[0]}")
    return 0


def _gb(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:7.3g}{unit}"
    return f"{x:7.3g} "


def table(preds, profile, spec) -> str:
    from trainspec.core.plan.transformer import parameters

    m = spec.model
    n_params = sum(p.size for p in parameters(m))
    lines = [f"# trainspec plan: {profile.name} ({profile.description}); memory and collectives as "
             f"{profile.backend} compiles the step; model {n_params:.3g} params, L={m.n_layers} "
             f"d={m.d_model} H={m.n_heads} d_ff={m.d_ff} V={m.vocab_size}; batch "
             f"{spec.batch.global_batch}x{spec.batch.seq_len} "
             f"({plural(spec.batch.accumulation_steps, 'micro-batch', 'micro-batches')}); {spec.precision.compute} compute; remat {spec.remat.policy}",
             f"# memory bytes per device; comm bytes of bus traffic per device per step; achievable "
             f"fraction {profile.achievable_fraction:.2f}, overlap {profile.comm_overlap:.2f}",
             f"{'rank':>4} {'layout (size/dcn)':<30} {'memory':>8} {'state':>8} {'act':>8} "
             f"{'ici':>8} {'dcn':>8} {'compute ms':>10} {'comm ms':>9} {'bubble ms':>9} "
             f"{'step ms':>9} {'MFU':>6}  fits"]
    for i, p in enumerate(preds, 1):
        lay = " ".join(f"{a}={s}" + (f"/{p.dcn[a]}" if p.dcn[a] > 1 else "")
                       for a, s in p.layout.items())
        if not p.fits:
            lines.append(f"{i:>4} {lay:<30} no: {'; '.join(p.reasons)}")
            continue
        mem = p.memory
        state = mem["params"] + mem["optimizer"] + mem["gradients"]
        ici = sum(c.ici_bus_bytes for c in p.collectives)
        dcn = sum(c.dcn_bus_bytes for c in p.collectives)
        lines.append(
            f"{i:>4} {lay:<30} {_gb(mem['total'])} {_gb(state)} {_gb(mem['activations'])} "
            f"{_gb(ici)} {_gb(dcn)} {p.compute_s * 1e3:>10.2f} {p.comm_s['exposed'] * 1e3:>9.2f} "
            f"{p.bubble_s * 1e3:>9.2f} {p.step_time_s * 1e3:>9.2f} {100 * p.mfu:>5.1f}%  yes"
            + (f"  stages: {_stages(p.pipeline)}" if p.pipeline else ""))
    return "\n".join(lines)


def _stages(pipeline: dict) -> str:
    """'1f1b m=16, layers 7+8x14+7, in flight 16 (stage 0)'."""
    counts, runs = pipeline["layers_per_stage"], []
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    layers = "+".join(f"{c}x{n}" if n > 1 else f"{c}" for c, n in runs)
    v = pipeline["virtual_stages"]
    return (f"{pipeline['schedule']} m={pipeline['microbatches']}" + (f" v={v}" if v > 1 else "")
            + f", layers {layers}, in flight {pipeline['in_flight'][0]:g} (stage 0)")


def plot(spec, profile, predict, path: Path, devices: int) -> None:
    """Best layout's step time and memory at each device count, per-device batch held."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainspec.core.plan import search
    from trainspec.core.spec import load_spec

    per_device = max(1, spec.batch.micro // devices)
    k = spec.batch.accumulation_steps

    def spec_for(n):
        return load_spec(spec, [f"batch.global_batch={per_device * n * k}",
                                f"batch.micro_batch={per_device * n}"])

    best = [(n, p) for n, p in search.best_per_count(spec_for, PLOT_COUNTS, profile, predict) if p]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([n for n, _ in best], [p.step_time_s for _, p in best], marker="o")
    b.plot([n for n, _ in best], [p.memory_bytes / 1e9 for _, p in best], marker="o")
    for ax, label in ((a, "predicted step time (s)"), (b, "memory per device (GB)")):
        ax.set(xscale="log", xlabel="devices", ylabel=label, title=f"{profile.name}: best layout")
        ax.grid(True, alpha=0.3)
    b.axhline(profile.memory_bytes / 1e9, color="red", linestyle="--", label="device memory")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

