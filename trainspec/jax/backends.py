"""The JAX implementation's collectives backends (`collectives.backend`), each declaring once
what it is and what it can do, so that the step, the mesh check, the capability table, the
conformance adapter, the benchmarks and the doctor read a property instead of testing names.

Framework-free (plain declarations, the modules named as strings and imported on first use):
the capability table reads it before jax starts, and the xla backend works on an install where
the compiled extension that `ext` needs is missing.
"""
from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

from trainspec.core.errors import UserInputError


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    module: str  # implements the op set (trainspec.jax.collectives.api dispatches to it)
    # docs/spec.md section 4. xla: XLA documents no reduction order, and NCCL picks ring or
    # tree algorithms by size and topology. hierarchical: its cross-process stage is the native
    # runtime, so it promises no more than xla, although its in-process stages are ext's sums.
    guarantee: str
    # XLA's own collectives: the step may leave the data reduction to XLA's partitioner; the
    # others are custom calls, which must carry it explicitly.
    native: bool
    # the module with its compressed gradient sum and error-feedback kernels (None: the
    # backend cannot compress; the hierarchical backend reduces float32)
    compression_kernels: str | None
    # its rendezvous spans the devices of one process only (ext): a group across processes is
    # measured over the in-process axis
    in_process_only: bool
    # it reduces the in-process and the cross-process part of a group in separate stages, so
    # each data axis must lie inside one process or entirely across processes
    splits_at_processes: bool
    # it may run beside XLA's collectives inside a replica (ext's blocking custom calls were
    # seen to deadlock beside them on CPU, docs/collectives.md)
    beside_xla: bool
    # `trainspec doctor` checks it on one host's devices (on one host hierarchical is ext)
    checked_on_one_host: bool

    def ops(self) -> ModuleType:
        try:
            return importlib.import_module(self.module)
        except ImportError as err:
            raise UserInputError(f"collectives backend {self.name!r} is not available: {err}") from err

    def kernels(self) -> ModuleType:
        """The compression kernels: `compressed_sum` and `feedback_round_trip`."""
        return importlib.import_module(self.compression_kernels)


_PACKAGE = "trainspec.jax.collectives"
BACKENDS = {b.name: b for b in (
    Backend("xla", f"{_PACKAGE}.xla", "nondeterministic", native=True,
            compression_kernels=f"{_PACKAGE}.compression", in_process_only=False,
            splits_at_processes=False, beside_xla=True, checked_on_one_host=True),
    Backend("ext", f"{_PACKAGE}.ext", "deterministic", native=False,
            compression_kernels=f"{_PACKAGE}.compression_ext", in_process_only=True,
            splits_at_processes=False, beside_xla=False, checked_on_one_host=True),
    Backend("hierarchical", f"{_PACKAGE}.hierarchical", "nondeterministic", native=False,
            compression_kernels=None, in_process_only=False, splits_at_processes=True,
            beside_xla=True, checked_on_one_host=False),
)}


def backend(name: str) -> Backend:
    """The backend called `name`; one line naming the known ones when there is none."""
    if name not in BACKENDS:
        raise UserInputError(f"unknown collectives backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]
