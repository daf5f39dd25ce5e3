"""A package's public names imported on first use (PEP 562): importing the package loads none
of the modules behind them (trainspec.jax, trainspec.torch)."""
from __future__ import annotations

import importlib


def on_first_use(package: str, entry_points: dict[str, str], public: list[str]):
    """The package's (`__getattr__`, `__dir__`): `entry_points` maps a name to the module that
    defines it; `public` is every public name, those the package defines itself included."""
    def __getattr__(name: str):
        if name not in entry_points:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(entry_points[name]), name)

    def __dir__():
        return sorted(public)

    return __getattr__, __dir__
