"""The backends, found by name: those registered under the `trainspec.backends` entry points
(trainspec.core.backend.Backend objects: the package's own `jax` and `torch`, and any an installed
package adds), and the conformance suite's targets, which are the backends' collectives variants,
third implementations under the `trainspec.implementations` entry points (an Adapter subclass)
and `module:Class`.

Nothing here imports a backend until one is asked for by name: listing names reads metadata.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import tomllib
from pathlib import Path

from trainspec.core.errors import UserInputError

BACKENDS = "trainspec.backends"
IMPLEMENTATIONS = "trainspec.implementations"
# A source tree on PYTHONPATH has no distribution metadata (bench/device_check.sh runs the CLI
# so), and an editable install's metadata is as old as its last install: the package's own
# backends are then read from the pyproject.toml beside it, where they are declared once.
_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def declared(group: str) -> dict[str, str]:
    """name -> "module:attribute" of everything registered under the entry points `group`:
    the package's own (its pyproject.toml, where there is one), then the installed packages'."""
    found = {}
    if _PYPROJECT.is_file():
        project = tomllib.loads(_PYPROJECT.read_text()).get("project", {})
        found.update(project.get("entry-points", {}).get(group, {}))
    found.update({ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)})
    return found


@functools.cache
def _declared() -> dict[str, str]:
    """name -> "module:attribute" of every registered backend."""
    return declared(BACKENDS)


def backend_names() -> list[str]:
    """The registered backends, the package's own first (jax, the default, then torch)."""
    return list(_declared())


def backend(name: str):
    """The Backend registered as `name`; UserInputError naming --framework otherwise."""
    declared = _declared()
    if name not in declared:
        raise UserInputError(f"--framework {name}: not a backend; one of "
                             f"{', '.join(declared)}")
    module_name, _, attribute = declared[name].partition(":")
    # a backend's module imports no framework (trainspec.core.backend.Backend)
    return getattr(importlib.import_module(module_name), attribute)


def _registered_implementations() -> dict[str, str]:
    return {ep.name: ep.value
            for ep in importlib.metadata.entry_points(group=IMPLEMENTATIONS)}


def conformance_targets() -> dict[str, str]:
    """--impl name -> the backend that answers it, for every backend's variants."""
    return {target: name for name in backend_names()
            for target in backend(name).conformance_targets}


def implementation_names() -> list[str]:
    """Every --impl name: the backends' variants, then the registered third implementations."""
    return [*conformance_targets(), *sorted(_registered_implementations())]


def implementation(name: str, join: bool = True):
    """The Adapter the suite runs against for --impl NAME: a backend's variant (in the joined
    job; `join=False` for its declarations only), a registered third implementation's, or
    `module:Class`'s (constructed without arguments)."""
    from trainspec.core.adapter import Adapter

    targets = conformance_targets()
    if name in targets:
        return backend(targets[name]).conformance(name, join)
    registered = _registered_implementations()
    if name in registered:
        target, where = registered[name], f"entry point {name!r} ({IMPLEMENTATIONS})"
    elif ":" in name:
        target, where = name, name
    else:
        raise UserInputError(f"--impl {name}: not an implementation; one of "
                             f"{', '.join(implementation_names())}, or module:Class")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserInputError(f"--impl {where}: cannot import {module_name!r} ({err})") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise UserInputError(f"--impl {where}: {module_name} has no Adapter subclass "
                             f"{class_name!r} (trainspec.core.adapter.Adapter)")
    return cls()


def third_implementation_names() -> list[str]:
    """The registered implementations outside the backends (their capability tables join the
    backends' in `trainspec conformance --capabilities`)."""
    return sorted(_registered_implementations())
