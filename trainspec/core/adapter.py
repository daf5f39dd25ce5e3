"""The adapter interface: what an implementation of the spec provides (docs/adapters.md).

Framework-free (imports neither jax nor torch): an implementation subclasses `Adapter`; the
conformance runner (`trainspec conformance --impl NAME`) and the training loops use only this
surface. Arrays are the framework's own; they cross frameworks through DLPack or NumPy.

Collectives act on the calling member's block, over the mesh axes `axes` (one name or a tuple,
ranked row-major in the tuple's order, like `lax.axis_index`), with the tiled semantics of
trainspec/core/collectives_reference.py, their arguments validated by
trainspec.core.collective_calls.check_call before anything is communicated.
"""
from __future__ import annotations

import abc
from typing import Any

from trainspec.core.capabilities import Capabilities

GUARANTEES = ("deterministic", "nondeterministic")  # docs/spec.md, section 4
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "permute")


class Adapter(abc.ABC):
    """One implementation of the spec. Subclasses set `name`, `guarantee_levels` and
    `capabilities`."""

    name: str
    # op -> the guarantee level the implementation declares for it (docs/spec.md, section 4)
    guarantee_levels: dict[str, str]
    # what it does with every field of the spec (trainspec/core/capabilities.py); the
    # conformance suite fails each field it does not declare, and counts the cases it refuses
    capabilities: Capabilities | None = None

    # -- devices and processes --------------------------------------------------------------
    @abc.abstractmethod
    def process_grid(self) -> tuple[int, int]:
        """This process's index and the job's number of processes (both known only once the
        framework's distributed runtime is up, so asked each time)."""

    @property
    def process_index(self) -> int:
        return self.process_grid()[0]

    @property
    def process_count(self) -> int:
        return self.process_grid()[1]

    @abc.abstractmethod
    def device_ids(self) -> list[int]:
        """Global ids of every device of the job, in the order meshes are laid out over."""

    def is_writer(self) -> bool:
        """Process 0 writes the job's shared files (metrics, summary)."""
        return self.process_index == 0

    # -- the mesh --------------------------------------------------------------------------
    @abc.abstractmethod
    def build_mesh(self, spec) -> Any:
        """The spec's mesh as the framework's own device-mesh object: the spec's axis names
        and sizes, in order, devices laid out row-major."""

    # -- collectives over named axes ---------------------------------------------------------
    @abc.abstractmethod
    def run_collective(self, mesh_shape, mesh_axes, collective: str, blocks, dtype: str, axes,
                       **kwargs) -> dict[tuple[int, ...], Any]:
        """Run `collective` over `axes` of a row-major grid of the job's first
        prod(mesh_shape) devices named `mesh_axes`, every member on its block of `blocks`
        (NumPy, (*mesh_shape, *local)) cast to `dtype`. Returns {member coordinates: result
        widened to float64 (int64 for int32)} for the members this process holds. The conformance
        runner calls this; programs use the framework's own in-program form."""

    @abc.abstractmethod
    def round_trip(self, x, dtype: str):
        """NumPy `x` cast to the framework's `dtype` and widened back (what a member holds)."""

    @abc.abstractmethod
    def gather_objects(self, obj) -> list:
        """Every process's `obj` (JSON-able), in process order, on every process."""

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

    # -- collectives.compression ------------------------------------------------------------
    # The compressions (besides "none") the implementation offers; none by default, and then
    # the conformance runner skips the compression families saying so.
    compressions: tuple[str, ...] = ()

    def error_feedback(self, x, residual, compression: str, block: int):
        """One replica's compression step on float32 NumPy vectors `x` and `residual`: (what
        the other replicas receive of x + residual, dequantized, float32; the replica's new
        residual, float32), as its gradient reduction computes them."""
        raise NotImplementedError(f"{self.name} implements no collectives.compression")

    # -- metrics -----------------------------------------------------------------------------
    def open_metrics(self, path, append: bool = False):
        """The core JSONL writer on the writing process, None elsewhere: every implementation
        writes records of the same schema (trainspec/core/metrics.schema.json) the same way."""
        from trainspec.core.records import JsonlWriter

        return JsonlWriter(path, append) if self.is_writer() else None
