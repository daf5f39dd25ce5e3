"""Registers the compiled xla_ext handlers with jax (once, at import of trainspec.jax).

The handlers are compiled against the XLA FFI headers of the jaxlib present at build time. Before
registering them, the XLA FFI API version they were compiled with is checked against the running
jaxlib's, so that a module built for another jaxlib fails here with one line instead of at the
first custom call.

Two modules: _xla_ext (CPU, always built) and _xla_ext_cuda (CUDA, built where the install found
nvcc: xla_ext/CMakeLists.txt, TRAINSPEC_CUDA). The CUDA handlers take the CPU handlers' target
names, registered for platform "CUDA", where a jax CUDA plugin is installed; jax applies them
when it starts its GPU backend, and XLA picks a handler by the platform it compiles for.
Nothing here starts a backend (jax.distributed.initialize must come first). `require_cuda`
refuses by name, in one line, what this install or this process cannot run on a GPU.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import jax
import jaxlib.version

from trainspec.jax import _xla_ext
from trainspec.core.errors import FfiVersionError, UserInputError

PLATFORM = "cpu"
CUDA_PLATFORM = "CUDA"
# The jax CUDA plugins (PJRT) whose presence means this process may get a GPU backend.
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")

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


def _check_version(module) -> None:
    built = module.build_info()
    problem = ffi_api_mismatch(tuple(built["xla_ffi_api"]), built["jaxlib"],
                               running_ffi_api(), jaxlib.version.__version__)
    if problem:
        raise FfiVersionError(problem)


def _register(module, platform: str) -> frozenset[str]:
    _check_version(module)
    names = []
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
        names.append(name)
    return frozenset(names)


def register_handlers() -> frozenset[str]:
    """Check the FFI API version, then register every CPU handler; returns their target names."""
    return _register(_xla_ext, PLATFORM)


def _cuda_plugin_installed() -> bool:
    try:
        return any(importlib.util.find_spec(name) is not None for name in _CUDA_PLUGINS)
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def cuda_module():
    """The CUDA module, or None where this install was built without it."""
    try:
        return importlib.import_module("trainspec.jax._xla_ext_cuda")
    except ImportError:
        return None


def register_cuda_handlers() -> frozenset[str]:
    """Register the CUDA handlers where they were built and jax may start a GPU backend."""
    module = cuda_module() if _cuda_plugin_installed() else None
    return _register(module, CUDA_PLATFORM) if module is not None else frozenset()


def require_cuda(target: str) -> None:
    """One line, naming the custom call `target`, if this process cannot run it on a GPU: no GPU
    backend, or an install built without the CUDA handlers."""
    platforms = sorted({d.platform for d in jax.devices()})
    if "gpu" not in platforms:
        raise UserInputError(f"collectives.backend = \"ext\": {target} on a GPU needs a GPU; "
                             f"this process has none (jax platforms: {', '.join(platforms)})")
    if target not in CUDA_TARGETS:
        raise UserInputError(
            f"collectives.backend = \"ext\": {target} on a GPU needs the xla_ext CUDA "
            f"handlers, which this install of trainspec was built without (no nvcc at install "
            f"time): reinstall with nvcc on PATH or with "
            f"`pip install -C cmake.define.TRAINSPEC_CUDA=ON --no-build-isolation .`")


TARGETS = register_handlers()
CUDA_TARGETS = register_cuda_handlers()
