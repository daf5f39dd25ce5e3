"""Registers the compiled xla_ext handlers with jax (once, at import of trainspec.jax).

The handlers are compiled against the XLA FFI headers of the jaxlib present at build time. Before
registering them, the XLA FFI API version they were compiled with is checked against the running
jaxlib's, so that a module built for another jaxlib fails here with one line instead of at the
first custom call.
"""
from __future__ import annotations

import re
from pathlib import Path

import jax
import jaxlib.version

from trainspec.jax import _xla_ext
from trainspec.core.errors import FfiVersionError

PLATFORM = "cpu"

_API_VERSION_DEFINE = re.compile(r"^#define XLA_FFI_API_(MAJOR|MINOR) (\d+)", re.MULTILINE)


def running_ffi_api() -> tuple[int, int]:
    """The XLA FFI API version of the installed jaxlib, read from the c_api.h it ships: the
    headers come from the same XLA build as the runtime, which jax exposes no other way."""
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    found = dict(_API_VERSION_DEFINE.findall(header.read_text()))
    return int(found["MAJOR"]), int(found["MINOR"])


def ffi_api_mismatch(built: tuple[int, int], built_jaxlib: str,
                     running: tuple[int, int], running_jaxlib: str) -> str | None:
    """Why handlers compiled for FFI API `built` cannot run on `running`, or None if they can.

    A major version change breaks the ABI. Within a major version the runtime accepts handlers of
    its own or an older minor version (it reads only the struct fields they know), but a handler
    compiled for a newer minor version may read fields an older runtime does not fill in."""
    if built[0] == running[0] and built[1] <= running[1]:
        return None
    return (f"trainspec.jax's xla_ext was compiled against jaxlib {built_jaxlib} (XLA FFI API "
            f"{built[0]}.{built[1]}) but jaxlib {running_jaxlib} (XLA FFI API "
            f"{running[0]}.{running[1]}) is installed; reinstall trainspec into this environment "
            f"with `pip install --no-build-isolation` so that it compiles against this jaxlib")


def register_handlers() -> frozenset[str]:
    """Check the FFI API version, then register every handler; returns their target names."""
    built = _xla_ext.build_info()
    problem = ffi_api_mismatch(tuple(built["xla_ffi_api"]), built["jaxlib"],
                               running_ffi_api(), jaxlib.version.__version__)
    if problem:
        raise FfiVersionError(problem)
    names = []
    for name, capsule in _xla_ext.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=PLATFORM)
        names.append(name)
    return frozenset(names)


TARGETS = register_handlers()
