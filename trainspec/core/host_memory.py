"""The host's memory, and the reference model's size against it before anything is allocated
(both implementations): a model far too large for the machine would otherwise spend minutes
building and gathering its parameters before the kernel kills the process, with no message."""
from __future__ import annotations

from pathlib import Path

from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec, reference_parameters

GIB = 2**30
MODEL_FIELDS = "model.d_model, model.d_ff, model.n_layers and model.vocab_size"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MOMENTS_BYTES = {"adamw": 8, "sgd": 0}  # two float32 moments per parameter, or none


def host_available_bytes() -> int | None:
    """Memory this process can still take: MemAvailable, capped by a cgroup limit; None where
    neither is known (not Linux)."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        cgroup = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if cgroup != "max":
            limits.append(int(cgroup) - used)
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def check_reference_model(spec: Spec, state_on_host: bool, available: int | None = None) -> None:
    """Refuse the reference model when the host cannot hold what it must, at the least: its
    initial parameters in float32 (gathered on the host and written to the run dir), and with
    `state_on_host` (CPU devices) one copy of the parameters and the optimizer's moments."""
    available = host_available_bytes() if available is None else available
    count = reference_parameters(spec.model)
    per_parameter = 4 + (DTYPE_BYTES[spec.precision.param] + MOMENTS_BYTES[spec.optimizer.name]
                         if state_on_host else 0)
    need = count * per_parameter
    if available is not None and need > available:
        raise UserInputError(
            f"{MODEL_FIELDS}: the model's {count:.3g} parameters need at least "
            f"{need / GIB:,.1f} GiB of host memory ({per_parameter} bytes each), and "
            f"{available / GIB:,.1f} GiB are available; choose a smaller model")
