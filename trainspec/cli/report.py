"""`trainspec report RUN.jsonl [RUN2.jsonl ...] --out DIR [--x tokens]`: tables in the terminal
(metrics, spec fields that differ), HTML + plots."""
from __future__ import annotations

from pathlib import Path

from trainspec.core.errors import UserInputError


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="summarise metrics JSONL runs: table, HTML, plots")
    p.add_argument("runs", nargs="+", type=Path, help="metrics JSONL files or run directories (first = baseline)")
    p.add_argument("--out", type=Path, default=Path("report"),
                   help="output directory (default: report); one holding a report is refused")
    p.add_argument("--force", action="store_true", help="replace the report already in --out")
    p.add_argument("--x", default="step", metavar="AXIS",
                   help="the curves' x-axis: step (default) or tokens (tokens trained so far)")
    p.set_defaults(func=run)


def check_out(out: Path, force: bool) -> None:
    """Refuse, before reading any run, an --out that would silently replace an earlier report
    (the default `report` is the same directory on every call) or that is not a directory."""
    if out.exists() and not out.is_dir():
        raise UserInputError(f"--out: {out} is a file, not a directory")
    if (out / "index.html").exists() and not force:
        raise UserInputError(f"--out: {out} already holds a report ({out / 'index.html'}); "
                             "give another --out, or --force to replace it")


def run(args) -> int:
    from trainspec.report.metrics_report import report

    check_out(args.out, args.force)
    text, page = report(args.runs, args.out, args.x)
    print(text)
    print(f"\nreport: {page}")
    return 0
