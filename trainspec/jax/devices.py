"""Present N host (CPU) devices before jax creates its CPU client, unless the user already chose.

On a CPU-only machine jax shows one device; the spec's meshes and the collectives bench need
several. XLA reads XLA_FLAGS when jax initialises its backends (the first device query), not at
`import jax`, so this works as long as nothing has touched a device yet; that matters because
importing the `trainspec.jax` package already imports jax. The flag only affects the CPU platform,
so it is harmless where accelerators are present.
"""
from __future__ import annotations

import os
import sys

from trainspec.core.errors import UserInputError

HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_HOST_DEVICES = 8
# XLA starts 1024 CPU devices in seconds; 100,000 kept `trainspec train` busy for minutes
# before it could say anything.
MAX_HOST_DEVICES = 1024


def _backends_initialized() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge  # private, hence the conservative fallback below
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def ensure_host_devices(n: int | None = None) -> None:
    """Set XLA_FLAGS for `n` host devices (default 8). A count already in XLA_FLAGS wins unless
    `n` is given explicitly. Must run before jax's first device query."""
    if n is not None and not 1 <= n <= MAX_HOST_DEVICES:
        raise UserInputError(f"--host-devices: expected 1 to {MAX_HOST_DEVICES} simulated "
                             f"devices, got {n}")
    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICE_FLAG in flags and n is None:
        return
    wanted = f"{HOST_DEVICE_FLAG}={n or DEFAULT_HOST_DEVICES}"
    if wanted in flags.split():
        return
    if _backends_initialized():
        raise RuntimeError("ensure_host_devices() must run before jax initialises its backends")
    kept = [f for f in flags.split() if not f.startswith(HOST_DEVICE_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(kept + [wanted])
