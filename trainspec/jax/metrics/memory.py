"""Per-device memory of the compiled step (XLA's memory analysis) and live bytes when reported."""
from __future__ import annotations

import jax


def compiled_memory(compiled) -> dict[str, int | None]:
    """Byte counts of one device's buffers for the compiled step (docs/metrics.md).

    `memory_peak_bytes` = arguments + outputs - aliased (donated) + temporaries: every buffer the
    executable can hold at once. XLA's own `peak_memory_in_bytes` is kept as
    `memory_xla_peak_bytes`, not used as the peak: XLA:CPU (jaxlib 0.10.2) reports about the
    argument size there, below the temporaries alone.
    """
    ma = compiled.memory_analysis()
    if ma is None:
        return {k: None for k in MEMORY_FIELDS}
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    alias, temp = int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes)
    xla_peak = getattr(ma, "peak_memory_in_bytes", None)
    return {
        "memory_peak_bytes": arg + out - alias + temp,
        "memory_argument_bytes": arg,
        "memory_output_bytes": out,
        "memory_alias_bytes": alias,
        "memory_temp_bytes": temp,
        "memory_generated_code_bytes": int(ma.generated_code_size_in_bytes),
        "memory_xla_peak_bytes": int(xla_peak) if xla_peak else None,
    }


MEMORY_FIELDS = ("memory_peak_bytes", "memory_argument_bytes", "memory_output_bytes",
                 "memory_alias_bytes", "memory_temp_bytes", "memory_generated_code_bytes",
                 "memory_xla_peak_bytes")


def live_bytes() -> int | None:
    """Largest `bytes_in_use` over this process's devices; None where the backend has no
    allocator statistics (CPU). A host call on the allocator, no device synchronisation."""
    values = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - backends without the call raise various errors
            stats = None
        if stats and "bytes_in_use" in stats:
            values.append(int(stats["bytes_in_use"]))
    return max(values) if values else None
