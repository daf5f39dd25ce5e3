"""`trainspec conformance --impl NAME`: the spec's conformance suite against one implementation,
as a pass/fail table with case counts (trainspec/core/conformance_runner.py). Exit 0 when every
case passes.

NAME is a built-in implementation (the JAX collectives backends `xla`, `ext`, `hierarchical`,
and `torch`), one registered by an installed package under the entry-point group
`trainspec.implementations` (name = "module:Class"), or `module:Class` itself: an Adapter
subclass (trainspec/core/adapter.py) constructed without arguments in this process.

The suite's collective layouts span 8 devices: the JAX backends run in this process on 8 CPU
devices; torch starts 8 ranks (one device each) through the launcher, as `train` does.
`--capabilities` prints the implementations' capability tables and `--count` the suite's
cases per family, running nothing (docs/adapters.md embeds both).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import sys

from trainspec.core.errors import UserInputError
from trainspec.jax.backends import BACKENDS

JAX_BACKENDS = tuple(BACKENDS)
BUILT_IN = (*JAX_BACKENDS, "torch")
ENTRY_POINTS = "trainspec.implementations"
SUITE_DEVICES = 8


def register(subparsers) -> None:
    p = subparsers.add_parser("conformance", help="run the conformance suite against an "
                              "implementation (a JAX collectives backend, torch, or another)")
    p.add_argument("--impl", metavar="NAME", help=f"{', '.join(BUILT_IN)}, an implementation "
                   f"registered under the {ENTRY_POINTS} entry points, or module:Class")
    p.add_argument("--quick", action="store_true", help="the collectives on 2 of the suite's "
                   "layouts and 3 dtypes only (the other families in full)")
    p.add_argument("--capabilities", action="store_true", help="print the capability table "
                   "(jax, torch, the registered implementations and --impl's) and run nothing")
    p.add_argument("--count", action="store_true", help="print the suite's cases per family "
                   "(in full and --quick) for the built-in implementations and --impl's, and "
                   "run nothing")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.capabilities or args.count:
        extra = [args.impl] if args.impl else []
        print(capability_markdown(extra) if args.capabilities else count_markdown(extra), end="")
        return 0
    if not args.impl:
        raise UserInputError("--impl: name the implementation to test "
                             f"({', '.join(BUILT_IN)}, a registered one, or module:Class)")
    if args.impl == "torch":
        return _torch(args)
    if args.impl in JAX_BACKENDS:
        return _report(args.impl, _jax_adapter(args.impl), args.quick)
    return _report(args.impl, load_adapter(args.impl)(), args.quick)


def _jax_adapter(backend: str):
    from trainspec.cli.devices import ensure_host_devices

    ensure_host_devices(SUITE_DEVICES)
    import jax

    if jax.device_count() < SUITE_DEVICES:
        raise UserInputError(f"--impl {backend}: the suite needs {SUITE_DEVICES} devices, "
                             f"{jax.device_count()} present")
    from trainspec.jax.adapter import JaxAdapter

    return JaxAdapter(backend)


def load_adapter(name: str) -> type:
    """The Adapter subclass NAME means: a registered entry point's, or module:Class."""
    from trainspec.core.adapter import Adapter

    registered = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}
    if name in registered:
        target, where = registered[name].value, f"entry point {name!r} ({ENTRY_POINTS})"
    elif ":" in name:
        target, where = name, name
    else:
        known = [*BUILT_IN, *sorted(registered)]
        raise UserInputError(f"--impl {name}: not an implementation; one of {', '.join(known)}, "
                             "or module:Class")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserInputError(f"--impl {where}: cannot import {module_name!r} ({err})") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise UserInputError(f"--impl {where}: {module_name} has no Adapter subclass "
                             f"{class_name!r} (trainspec.core.adapter.Adapter)")
    return cls


def adapter_for_counting(name: str):
    """An adapter whose declarations the suite's cases depend on, built without devices."""
    if name == "torch":
        from trainspec.torch.adapter import TorchAdapter

        return TorchAdapter()
    if name in JAX_BACKENDS:
        from trainspec.jax.adapter import JaxAdapter

        return JaxAdapter(name)
    return load_adapter(name)()


def count_markdown(extra: list[str] = ()) -> str:
    """The suite's cases per family for each implementation, in full (and with --quick);
    '-' where a family is skipped; refused cases are not counted."""
    from trainspec.core.conformance_runner import count_cases

    names = [*BUILT_IN, *(n for n in extra if n not in BUILT_IN)]
    counts = {}
    for name in names:
        adapter = adapter_for_counting(name)
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
    """The capability tables side by side: jax, torch, then the registered implementations
    and `extra` (names as --impl takes them)."""
    from trainspec.core.capabilities import markdown, schema_fields
    from trainspec.jax.capabilities import JAX
    from trainspec.torch.capabilities import TORCH

    names = [ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)]
    others = [load_adapter(n).capabilities for n in [*names, *extra] if n not in BUILT_IN]
    return markdown([JAX, TORCH, *(t for t in others if t is not None)],
                    [*schema_fields(), *train_flags()])


def train_flags() -> list[str]:
    """The options of `trainspec train`, as the capability tables name them."""
    import argparse

    from trainspec.cli import train

    commands = argparse.ArgumentParser().add_subparsers()
    train.register(commands)
    return [a.option_strings[-1] for a in commands.choices["train"]._actions
            if a.option_strings and a.dest != "help"]


def _torch(args) -> int:
    from trainspec.torch.support import launched

    if not launched():
        from trainspec.core.launch import run as launch

        return launch([sys.executable, "-m", "trainspec.cli.main", *args.argv], SUITE_DEVICES)
    from trainspec.torch.adapter import TorchAdapter

    adapter = TorchAdapter()
    adapter.join()
    if adapter.process_count != SUITE_DEVICES:
        raise UserInputError(f"--impl torch: the suite needs {SUITE_DEVICES} ranks, "
                             f"the job has {adapter.process_count}")
    try:
        return _report("torch", adapter, args.quick)
    finally:
        adapter.leave()


def _report(impl: str, adapter, quick: bool) -> int:
    from trainspec.core.conformance_runner import run as run_suite, table

    rows = run_suite(adapter, quick)
    if adapter.is_writer():
        print(table(impl, rows))
    return 0 if not any(r.failed for r in rows) else 1
