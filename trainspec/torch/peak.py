"""The MFU denominator of a torch rank: the spec's override, the machine's measured CPU peak
(trainspec.core.cpu_peak, the cache the JAX implementation reads too) or the table.

Ranks on one host share its cores (trainspec.torch.runtime gives each a share of the threads),
so a rank's peak is the process peak divided by the ranks on the host, as a JAX process's is
divided by its simulated devices. On a cache miss rank 0 measures with every thread while the
other ranks wait, then all read the same entry.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from trainspec.core import cpu_peak, flops
from trainspec.core.spec import Spec


def matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    """Best float32 matmul FLOP/s of this process on all of the host's cores."""
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return cpu_peak.best_rate(lambda: torch.mm(a, a), n, repeats)
    finally:
        torch.set_num_threads(threads)


def measure(sizes=cpu_peak.SIZES, repeats: int = 5) -> dict:
    return cpu_peak.entry({n: matmul_peak(n, repeats) for n in sizes}, f"torch {torch.__version__}")


def _measured_once() -> flops.Peak | None:
    """The cached peak; on a miss rank 0 measures it and the others read it after a barrier."""
    if cpu_peak.mode() == "table" or cpu_peak.cached() is not None:
        return cpu_peak.process_peak(None)
    if dist.get_rank() == 0:
        cpu_peak.process_peak(measure)
    dist.barrier()
    return cpu_peak.process_peak(None)


def peak_flops(spec: Spec, device_type: str, local_ranks: int) -> flops.Peak:
    """One rank's peak FLOP/s per trainspec.core.flops (the spec, the table), measured on a CPU."""
    kind = torch.cuda.get_device_name() if device_type == "cuda" else "cpu"
    measured = None
    if kind == "cpu" and not spec.metrics.peak_flops_per_device:
        measured = _measured_once()
    return flops.peak_flops(spec, kind, local_ranks, measured)
