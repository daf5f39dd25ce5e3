"""`trainspec launch --nprocs N -- COMMAND ...`: N local processes as one jax.distributed job."""
from __future__ import annotations

import argparse
import shutil

from trainspec.cli.options import integer, real
from trainspec.core.errors import UserInputError
from trainspec.core.launch import DEFAULT_GRACE_S


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", help="run a command as N local processes of one distributed job",
        description="Starts N processes on 127.0.0.1 (gloo CPU collectives), prefixes their "
        "output by rank, forwards signals, and stops all of them if one fails.",
    )
    p.add_argument("--nprocs", type=integer, required=True, help="number of processes")
    p.add_argument("--grace", type=real, default=DEFAULT_GRACE_S,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks: on a SIGTERM "
                   f"to the launcher, the time the ranks have to write their checkpoint "
                   f"(default {DEFAULT_GRACE_S:g})")
    p.add_argument("--bind", choices=("numa", "cores", "none"),
                   help="pin each rank (and its threads) to the CPUs of one NUMA node, to an "
                   "equal block of cores, or not at all (default: numa where there are several "
                   "NUMA nodes, else none)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show gloo's '[Gloo] Rank N is connected to M peer ranks' lines")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    p.set_defaults(func=run)


def run(args) -> int:
    from trainspec.core.launch import run as launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UserInputError("launch: give the command after --, e.g. -- trainspec train")
    if shutil.which(command[0]) is None:
        raise UserInputError(f"launch: command not found: {command[0]}")
    if args.nprocs < 1:
        raise UserInputError(f"--nprocs must be at least 1, got {args.nprocs}")
    if args.grace < 0:
        raise UserInputError(f"--grace must be >= 0, got {args.grace}")
    return launch(command, args.nprocs, args.grace, bind=args.bind, verbose=args.verbose)
