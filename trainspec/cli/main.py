"""`trainspec` entry point: parse, dispatch to a subcommand module, turn bad input into one line.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its parser
and sets `func(args) -> int` as the parser default.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import logging
import sys

from trainspec.cli.outcomes import OUTCOMES, end, outcome_of
from trainspec.core import run_lock

SUBCOMMAND_MODULES = ("train", "validate", "bench", "report", "launch", "advise", "sweep", "scaling",
                      "conformance", "plan", "doctor", "export")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2, like ours
        self.exit(2, f"trainspec: error: {message}\n")


def _version() -> str:
    """The installed distribution's version; a source tree on PYTHONPATH (bench/device_check.sh
    where the package cannot be built) has no distribution metadata and must still run."""
    try:
        return importlib.metadata.version("trainspec")
    except importlib.metadata.PackageNotFoundError:
        return "(source tree, not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trainspec",
                     description="Run and measure spec-driven training on JAX or PyTorch.")
    parser.add_argument("--version", action="version", version=f"trainspec {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"trainspec.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse's --help and usage errors: return, don't raise
        return int(exit_.code or 0)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to start ranks of the same command
    args.speaks_for_job = lambda: True  # a command that joins a job asks its runtime
    try:
        with _library_warnings_as_lines(), run_lock.released_at_exit():
            return args.func(args) or 0
    except tuple(outcome.kind for outcome in OUTCOMES) as err:
        return end(outcome_of(err), err, args.speaks_for_job())
    except ModuleNotFoundError as err:  # a framework this command needs, not installed
        extra = framework_extras().get((err.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"trainspec: error: this command needs {err.name}, which is not installed: "
              f"pip install 'trainspec[{extra}]'", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trainspec validate ... | head`: the reader left, nothing to say
        _silence_stdout()
        return 0
    except KeyboardInterrupt:
        print("trainspec: interrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _library_warnings_as_lines():
    """The library's warnings (a bad checkpoint set aside, one moved by --restart, a device that
    failed preflight) as `trainspec: ...` lines on stderr, like the command's own. Through the
    root logger they would read `WARNING:trainspec.jax.checkpoint:...`: absl configures it with
    logging's basic format the first time orbax logs."""
    logger = logging.getLogger("trainspec")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("trainspec: %(message)s"))
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def framework_extras() -> dict[str, str]:
    """The frameworks are extras of the package (pyproject.toml): module -> the extra that
    brings it, as each registered backend declares."""
    from trainspec.core import registry

    return {module: backend.extra for name in registry.backend_names()
            for backend in [registry.backend(name)] for module in backend.framework_modules}


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    import os
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no file descriptor (replaced in tests)
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
