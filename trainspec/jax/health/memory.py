"""Before the first step: refuse a job that cannot fit, with one line naming the fields.

Without it, a batch far too large for the machine trains until the kernel kills the process
with no message. Two checks, each before the memory is taken:
- the host batch (this process's rows) against the host's available memory, before the first
  batch is built;
- the compiled step's per-device buffers (arguments + outputs - donated + temporaries, XLA's
  memory analysis) against each device's memory, before the first step; CPU devices share the
  host's memory, so there the sum over this process's devices is compared with it.
"""
from __future__ import annotations

import jax

from trainspec.core.errors import UserInputError
from trainspec.core.host_memory import GIB, host_available_bytes  # noqa: F401 (re-exported)

# The fields that size the step's memory, named in every refusal.
SIZE_FIELDS = "batch.global_batch, batch.micro_batch, batch.seq_len and the [model] sizes"


def _refuse(need: int, have: int, what: str) -> None:
    raise UserInputError(
        f"{SIZE_FIELDS}: {what} needs {need / GIB:.2f} GiB but {have / GIB:.2f} GiB are "
        "available; use a smaller batch (or batch.micro_batch for accumulation) or model")


def check_host_batch(batch_bytes: int, available: int | None = None) -> None:
    available = host_available_bytes() if available is None else available
    if available is not None and batch_bytes > available:
        _refuse(batch_bytes, available, "this process's share of the batch")


def device_limit_bytes(device) -> int | None:
    """The device's memory, where its allocator reports it (GPU, TPU); None on CPU."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without the call raise various errors
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def check_step(memory: dict, devices=None, host_available: int | None = None) -> None:
    """Refuse when the compiled step's buffers exceed what its devices (or the host) have.

    `memory`: the step's `memory_peak_bytes` and `memory_argument_bytes` per device
    (trainspec.jax.metrics.memory). On the host the arguments (state, batch) already exist when this
    runs, so only the rest of the peak must still fit into what is available."""
    peak, arguments = memory.get("memory_peak_bytes"), memory.get("memory_argument_bytes") or 0
    if not peak:
        return
    devices = list(devices if devices is not None else jax.local_devices())
    on_host = [d for d in devices if device_limit_bytes(d) is None]
    for device in devices:
        limit = device_limit_bytes(device)
        if limit is not None and peak > limit:
            _refuse(peak, limit, f"the compiled step on device {device.id}")
    available = host_available_bytes() if host_available is None else host_available
    need = (peak - arguments) * len(on_host)
    if on_host and available is not None and need > available:
        _refuse(need, available, f"the compiled step's buffers on {len(on_host)} host devices")
