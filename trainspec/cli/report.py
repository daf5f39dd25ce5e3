"""`trainspec report RUN.jsonl [RUN2.jsonl ...] --out DIR`: table in the terminal, HTML + plots."""
from __future__ import annotations

from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="summarise metrics JSONL runs: table, HTML, plots")
    p.add_argument("runs", nargs="+", type=Path, help="metrics JSONL files or run directories (first = baseline)")
    p.add_argument("--out", type=Path, default=Path("report"), help="output directory")
    p.set_defaults(func=run)


def run(args) -> int:
    from trainspec.report.metrics_report import report

    text, page = report(args.runs, args.out)
    print(text)
    print(f"\nreport: {page}")
    return 0
