"""Registers the compiled xla_ext handlers with jax (once, at import of spec_jax)."""
from __future__ import annotations

import jax

from spec_jax import _xla_ext

PLATFORM = "cpu"


def _register() -> frozenset[str]:
    names = []
    for name, capsule in _xla_ext.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=PLATFORM)
        names.append(name)
    return frozenset(names)


TARGETS = _register()
