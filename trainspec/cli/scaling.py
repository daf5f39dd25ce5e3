"""`trainspec scaling RUN... [--predict-params N --predict-tokens D] [--predict-compute C]`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from trainspec.cli.options import add_outputs, integer, real


def register(subparsers) -> None:
    p = subparsers.add_parser("scaling", help="fit scaling laws to sweep runs and predict a run")
    p.add_argument("runs", nargs="+", type=Path, help="run directories with scaling.json, or "
                   "sweep directories holding them")
    p.add_argument("--predict-params", type=real, help="N of the run to predict")
    p.add_argument("--predict-tokens", type=real, help="D of the run to predict")
    p.add_argument("--predict-compute", type=real, help="C (model FLOPs) of the run to predict")
    p.add_argument("--bootstrap", type=integer, default=100, help="bootstrap resamples (default 100)")
    add_outputs(p, json="write fits and prediction as JSON",
                plot="write a PNG of the fit, points and prediction")
    p.set_defaults(func=run)


def run(args) -> int:
    from trainspec.core.errors import UserInputError
    from trainspec.core import scaling
    from trainspec.report.advice_plots import plot_scaling

    if (args.predict_params is None) != (args.predict_tokens is None):
        raise UserInputError("--predict-params and --predict-tokens go together")
    if args.bootstrap < 10:
        raise UserInputError(f"--bootstrap: at least 10 resamples, got {args.bootstrap}")
    points = scaling.read_points(args.runs)
    fits = scaling.fit_points(points, args.bootstrap)
    compute = args.predict_compute
    if compute is None and args.predict_params is not None:
        compute = 6.0 * args.predict_params * args.predict_tokens  # 6 N D when only N, D given
    prediction = scaling.predict(fits, args.predict_params, args.predict_tokens, compute)
    warnings = scaling.caveats(points, fits)
    for line in warnings:
        print(f"trainspec: warning: {line}", file=sys.stderr)
    result = {"points": points, "fits": scaling.describe(fits), "prediction": prediction,
              "warnings": warnings}
    for key, coefs in result["fits"].items():
        print(f"{key}: " + ", ".join(f"{k} {v['value']:.4g} [{v['ci95'][0]:.4g}, {v['ci95'][1]:.4g}]"
                                     for k, v in coefs.items() if k != "rms_log_residual")
              + f"; rms log residual {coefs['rms_log_residual']:.4f}")
    for key, p in prediction.items():
        print(f"predicted loss ({key}): {p['loss']:.4f}, 95% interval [{p['low']:.4f}, {p['high']:.4f}]")
    if args.plot:
        print(f"plot: {plot_scaling(points, fits, prediction, {'compute': compute}, args.plot)}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"json: {args.json}")
    return 0
