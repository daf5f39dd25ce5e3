"""Options that several `trainspec` commands take alike, declared once: the spec overrides,
the simulated device count, and the JSON/PNG outputs. Each command adds what it needs."""
from __future__ import annotations

import argparse
from pathlib import Path


def ascii_number(kind: type, text: str) -> int | float:
    """`text` read as `kind` (int or float), or ValueError. Python's int() and float() read the
    digits of every script ("８" is 8, "٣" is 3): a number typed in them is a slip no shell,
    spec or log means, refused like any other non-number."""
    if not text.isascii():
        raise ValueError(f"not ASCII: {text!r}")
    return kind(text)


def _number(kind: type, what: str):
    def parse(text: str) -> int | float:
        try:
            return ascii_number(kind, text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


# argparse types for an integer or a number in ASCII digits, else a one-line usage error
# naming the argument.
integer = _number(int, "an integer")
real = _number(float, "a number")


def at_least(minimum: int):
    """An argparse type: an integer >= `minimum`, else argparse's one-line usage error."""
    def parse(text: str) -> int:
        try:
            value = ascii_number(int, text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return parse


def comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_overrides(p: argparse.ArgumentParser, help: str = "override a spec field (repeatable)"):
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY.PATH=VALUE", help=help)


def add_host_devices(p: argparse.ArgumentParser, minimum: int | None = None) -> None:
    """--host-devices N; below `minimum` argparse refuses it, below 1 ensure_host_devices does."""
    p.add_argument("--host-devices", type=at_least(minimum) if minimum else integer,
                   help="CPU devices to present (default 8, or as XLA_FLAGS says)")


def add_outputs(p: argparse.ArgumentParser, *, json: str | None = None,
                plot: str | None = None) -> None:
    """--json FILE and/or --plot FILE.png, each with what it writes."""
    for flag, help in (("--json", json), ("--plot", plot)):
        if help:
            p.add_argument(flag, type=Path, help=help)


def add_framework(p: argparse.ArgumentParser, what: str) -> None:
    """--framework NAME: one of the registered backends (trainspec.core.registry), the first
    (the package's reference backend) by default."""
    from trainspec.core.registry import backend_names

    names = backend_names()
    p.add_argument("--framework", choices=names, default=names[0],
                   help=f"{what} (default {names[0]}; docs/adapters.md)")
