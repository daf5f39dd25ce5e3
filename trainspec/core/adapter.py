"""The conformance suite's view of an implementation (docs/adapters.md): its runtime and
collectives (trainspec.core.backend), fingerprints and DLPack, and the reference job.

Framework-free (imports neither jax nor torch): an implementation subclasses `Adapter`; the
conformance runner (`trainspec conformance --impl NAME`) uses only this surface. Arrays are the
framework's own; they cross frameworks through DLPack or NumPy. A backend's adapter is its
`conformance` module (trainspec/jax/conformance.py, trainspec/torch/conformance.py); a third
implementation outside the package writes one on its own (tests/conformance/numpy_impl.py).
"""
from __future__ import annotations

import abc
from typing import Any

from trainspec.core.backend import GUARANTEES, OPS, Collectives, Runtime
from trainspec.core.capabilities import Capabilities

__all__ = ["GUARANTEES", "OPS", "Adapter"]


class Adapter(Runtime, Collectives):
    """One implementation of the spec under the suite. Subclasses set `name`,
    `guarantee_levels` and `capabilities`."""

    # what it does with every field of the spec (trainspec/core/capabilities.py); the
    # conformance suite fails each field it does not declare, and counts the cases it refuses
    capabilities: Capabilities | None = None

    # -- arrays ------------------------------------------------------------------------------
    @abc.abstractmethod
    def to_dlpack(self, x) -> Any:
        """An object with __dlpack__ (or a capsule) viewing `x` without a copy."""

    @abc.abstractmethod
    def from_dlpack(self, obj) -> Any:
        """The framework's array viewing a DLPack-exporting object (e.g. a NumPy array)."""

    @abc.abstractmethod
    def fingerprint(self, x) -> tuple[int, int]:
        """(low, high) 32-bit words of the bytes of the local block `x`, bit-identical to
        trainspec.core.fingerprint.fingerprint_reference of the same bytes."""

    # -- the reference job (conformance: trajectories, accumulation, layouts, records) ----------
    @abc.abstractmethod
    def train_steps(self, spec, params: dict,
                    batches: list[dict]) -> list[tuple[float, float, dict]]:
        """Steps of the reference transformer under `spec`, a fresh optimizer state starting
        from `params` (the flax parameter tree of NumPy arrays, the layout every implementation
        converts from and to), one step per global batch of `batches` (NumPy
        {"inputs", "targets", "mask"}). Per step: (loss, gradient norm before clipping,
        parameters after the step in the same tree layout, NumPy), identical on every process."""

    @abc.abstractmethod
    def train_run(self, spec, run_dir, steps: int) -> dict:
        """`trainspec train` of the reference job in `run_dir` for `steps` steps: its summary."""

    # -- metrics -----------------------------------------------------------------------------
    def open_metrics(self, path, append: bool = False):
        """The core JSONL writer on the writing process, None elsewhere: every implementation
        writes records of the same schema (trainspec/core/metrics.schema.json) the same way."""
        from trainspec.core.records import JsonlWriter

        return JsonlWriter(path, append) if self.is_writer() else None
