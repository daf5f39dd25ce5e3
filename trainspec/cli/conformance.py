"""`trainspec conformance --impl NAME`: the spec's conformance suite against one implementation,
as a pass/fail table with case counts (trainspec/core/conformance_runner.py). Exit 0 when every
case passes.

NAME is one of the registered backends' variants (trainspec.core.registry: jax's collectives
`xla`, `ext`, `hierarchical`; `torch`), one registered by an installed package under the
entry-point group `trainspec.implementations` (name = "module:Class"), or `module:Class`
itself: an Adapter subclass (trainspec/core/adapter.py) constructed without arguments in this
process.

The suite's collective layouts span 8 devices: each backend says where they are
(Backend.suite_ranks): jax runs in this process on 8 CPU devices; torch starts 8 ranks (one
device each) through the launcher, as `train` does.
`--capabilities` prints the implementations' capability tables and `--count` the suite's
cases per family, running nothing (docs/adapters.md embeds both).
"""
from __future__ import annotations

import sys

from trainspec.core import registry
from trainspec.core.errors import UserInputError


def register(subparsers) -> None:
    p = subparsers.add_parser("conformance", help="run the conformance suite against an "
                              "implementation (a backend's collectives variant, or another)")
    p.add_argument("--impl", metavar="NAME", help="a backend's variant (xla, ext, hierarchical, "
                   f"torch), an implementation registered under the {registry.IMPLEMENTATIONS} "
                   "entry points, or module:Class")
    p.add_argument("--quick", action="store_true", help="the collectives on 2 of the suite's "
                   "layouts and 3 dtypes only (the other families in full)")
    p.add_argument("--capabilities", action="store_true", help="print the capability table "
                   "(the backends', the registered implementations' and --impl's) and run "
                   "nothing")
    p.add_argument("--count", action="store_true", help="print the suite's cases per family "
                   "(in full and --quick) for the backends' variants and --impl's, and run "
                   "nothing")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.capabilities or args.count:
        extra = [args.impl] if args.impl else []
        print(capability_markdown(extra) if args.capabilities else count_markdown(extra), end="")
        return 0
    if not args.impl:
        raise UserInputError("--impl: name the implementation to test "
                             f"({', '.join(registry.implementation_names())}, or module:Class)")
    from trainspec.core.conformance_runner import SUITE_DEVICES, run as run_suite, table

    targets = registry.conformance_targets()
    if args.impl in targets:  # a backend's: on the suite's devices, started here if need be
        ranks = registry.backend(targets[args.impl]).suite_ranks(SUITE_DEVICES)
        if ranks is not None:
            from trainspec.core.launch import run as launch

            return launch([sys.executable, "-m", "trainspec.cli.main", *args.argv], ranks)
    adapter = registry.implementation(args.impl)
    try:
        rows = run_suite(adapter, args.quick)
        if adapter.is_writer():
            print(table(args.impl, rows))
    finally:
        adapter.leave()
    return 0 if not any(r.failed for r in rows) else 1


def count_markdown(extra: list[str] = ()) -> str:
    """The suite's cases per family for each implementation, in full (and with --quick);
    '-' where a family is skipped; refused cases are not counted."""
    from trainspec.core.conformance_runner import count_cases

    built_in = list(registry.conformance_targets())
    names = [*built_in, *(n for n in extra if n not in built_in)]
    counts = {}
    for name in names:
        adapter = registry.implementation(name, join=False)
        full, quick = count_cases(adapter), count_cases(adapter, quick=True)
        counts[name] = [("-" if f.skipped else f"{f.passed}" if f.passed == q.passed
                         else f"{f.passed} ({q.passed})") for f, q in zip(full, quick)]
        counts[name].append(f"{sum(r.passed for r in full)} ({sum(r.passed for r in quick)})")
    families = [r.family for r in full] + ["total"]
    rows = ["| family | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    rows += [f"| {family} | " + " | ".join(counts[n][i] for n in names) + " |"
             for i, family in enumerate(families)]
    return "\n".join(rows) + "\n"


def capability_markdown(extra: list[str] = ()) -> str:
    """The capability tables side by side: the backends' (jax, torch), then the registered
    implementations' and `extra`'s (names as --impl takes them)."""
    from trainspec.core.capabilities import markdown, schema_fields

    backends = [registry.backend(name).capabilities for name in registry.backend_names()]
    built_in = registry.conformance_targets()
    others = [registry.implementation(n, join=False).capabilities
              for n in [*registry.third_implementation_names(), *extra] if n not in built_in]
    return markdown([*backends, *(t for t in others if t is not None)],
                    [*schema_fields(), *train_flags()])


def train_flags() -> list[str]:
    """The options of `trainspec train`, as the capability tables name them."""
    import argparse

    from trainspec.cli import train

    commands = argparse.ArgumentParser().add_subparsers()
    train.register(commands)
    return [a.option_strings[-1] for a in commands.choices["train"]._actions
            if a.option_strings and a.dest != "help"]
