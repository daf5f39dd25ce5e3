"""`trainspec conformance --impl NAME`: the spec's conformance suite against one implementation,
as a pass/fail table with case counts (trainspec/core/conformance_runner.py). Exit 0 when every case passes.

The suite's collective layouts span 8 devices: the JAX backends run in this process on 8 CPU
devices; torch starts 8 ranks (one device each) through the launcher, as `train` does.
"""
from __future__ import annotations

import sys

from trainspec.core.errors import UserInputError

IMPLEMENTATIONS = ("xla", "ext", "hierarchical", "torch")
SUITE_DEVICES = 8


def register(subparsers) -> None:
    p = subparsers.add_parser("conformance", help="run the conformance suite against an "
                              "implementation (a JAX collectives backend, or torch)")
    p.add_argument("--impl", choices=IMPLEMENTATIONS, required=True, help="implementation")
    p.add_argument("--quick", action="store_true", help="the collectives on 2 of the suite's "
                   "layouts and 3 dtypes only (the other families in full)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.impl == "torch":
        return _torch(args)
    from trainspec.cli.devices import ensure_host_devices

    ensure_host_devices(SUITE_DEVICES)
    import jax

    if jax.device_count() < SUITE_DEVICES:
        raise UserInputError(f"--impl {args.impl}: the suite needs {SUITE_DEVICES} devices, "
                             f"{jax.device_count()} present")
    from trainspec.jax.adapter import JaxAdapter

    return _report(args.impl, JaxAdapter(args.impl), args.quick)


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
