"""The spec's mesh in plain integers: axis sizes, and which devices (ranks) each axis groups.

An implementation lists its devices in one order (JAX: `jax.devices()`; torch: global ranks),
process-major, and names each device by an integer id. `place_devices` removes the excluded ids,
resolves the `-1` axis, and lays the remaining ids out in the mesh shape. From that grid,
`PlacedMesh.groups(axes)` gives the rank groups one collective over those axes spans.

ICI (within a process) and DCN (across processes) factors are kept apart: with several
processes, the grid is a block grid of processes (shape `dcn`), each block the process's own
devices (shape `ici`), so an axis that spans hosts puts only its cross-host part on the slow
links (MaxText's hybrid mesh; jax's `create_hybrid_device_mesh` lays devices out the same way).
In one process the dcn factors are laid out within it: a multi-host spec runs unchanged, and
computes the same, on one machine (docs/spec.md).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from trainspec.core.errors import UserInputError
from trainspec.core.spec import FieldError, Spec, check_pipeline
from trainspec.core.spec_sequence import sequence_and_expert_errors


def mesh_text(shape: Mapping[str, int]) -> str:
    """A mesh as messages and records name it: 'data=8 x fsdp=1 x tensor=1'."""
    return " x ".join(f"{name}={size}" for name, size in shape.items())


@dataclass(frozen=True)
class ParallelDims:
    """The spec's mesh resolved once for a device count: every axis's name, size (the `-1`
    resolved), role and cross-process (dcn) factor, in spec order, and what follows from them.

    One object that the JAX and torch steps, their mesh building and the planner take, so that
    none of them works sizes out of the spec again (after torchtitan's ParallelDims, which
    holds the degrees of each kind of parallelism of a job and builds its mesh from them).
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    roles: tuple[str, ...]
    dcn: tuple[int, ...]

    @classmethod
    def of(cls, spec: Spec, sizes: Mapping[str, int],
           dcn: Mapping[str, int] | None = None) -> ParallelDims:
        """The dims of axis `sizes` given by name (a mesh already built, a layout the planner
        tries), in spec order; `dcn` by name, else the spec's."""
        names = tuple(spec.mesh.axes)
        dcn = dcn or {name: axis.dcn for name, axis in spec.mesh.axes.items()}
        return cls(names, tuple(int(sizes[n]) for n in names),
                   tuple(spec.mesh.role_of(n) for n in names), tuple(int(dcn[n]) for n in names))

    @property
    def shape(self) -> dict[str, int]:
        """{axis: size}, in spec order (as `jax.sharding.Mesh.shape` names them)."""
        return dict(zip(self.names, self.sizes))

    @property
    def dcn_shape(self) -> dict[str, int]:
        return dict(zip(self.names, self.dcn))

    @property
    def ici(self) -> tuple[int, ...]:
        return tuple(s // d for s, d in zip(self.sizes, self.dcn))

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size_of(self, axes: Sequence[str]) -> int:
        return math.prod(self.sizes[self.names.index(a)] for a in axes)

    def group(self, axes: Sequence[str]) -> tuple[int, int]:
        """(devices, of which cross-process factor) of one group a collective over `axes` spans."""
        return self.size_of(axes), math.prod(self.dcn[self.names.index(a)] for a in axes)

    def axes_with_role(self, role: str) -> tuple[str, ...]:
        return tuple(n for n, r in zip(self.names, self.roles) if r == role)

    def split(self, role: str) -> tuple[str, ...]:
        """The axes of `role` that split something (more than one device), in spec order."""
        return tuple(n for n, r, s in zip(self.names, self.roles, self.sizes) if r == role and s > 1)

    def split_beside(self, role: str) -> tuple[str, ...]:
        """The axes of every other role that split."""
        return tuple(n for n, r, s in zip(self.names, self.roles, self.sizes) if r != role and s > 1)

    def degree(self, role: str) -> int:
        """How many ways the axes of `role` split (1 when none)."""
        return self.size_of(self.axes_with_role(role))

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the ways the data axes split the batch."""
        return self.degree("data")

    @property
    def fsdp(self) -> int:
        return self.degree("fsdp")

    @property
    def tensor(self) -> int:
        return self.degree("tensor")

    @property
    def stages(self) -> int:
        """Pipeline stages: the size of the pipeline axis (1 when there is none)."""
        return self.degree("pipeline")

    def describe(self) -> str:
        return mesh_text(self.shape)


def resolve_mesh(spec: Spec, n_devices: int) -> ParallelDims:
    """Resolve the spec's axis sizes for `n_devices`; a clear error when they do not factor."""
    names = tuple(spec.mesh.axes)
    fixed = math.prod(a.size for a in spec.mesh.axes.values() if a.size != -1)
    sizes = []
    for name, axis in spec.mesh.axes.items():
        if axis.size != -1:
            sizes.append(axis.size)
            continue
        if n_devices % fixed:
            raise UserInputError(
                f"mesh.axes: cannot infer '{name}': {n_devices} devices are not divisible by "
                f"the product {fixed} of the other axes"
            )
        inferred = n_devices // fixed
        if inferred % axis.dcn:
            raise UserInputError(
                f"mesh.axes.{name}: inferred size {inferred} is not a multiple of dcn {axis.dcn}"
            )
        sizes.append(inferred)
    if math.prod(sizes) != n_devices:
        raise UserInputError(
            f"mesh.axes: {' x '.join(f'{n}={s}' for n, s in zip(names, sizes))} needs "
            f"{math.prod(sizes)} devices, but {n_devices} are available"
        )
    for field, message in sequence_and_expert_errors(spec, dict(zip(names, sizes)))[:1]:
        raise UserInputError(f"{field}: {message}")  # an inferred context or expert axis
    dims = ParallelDims.of(spec, dict(zip(names, sizes)))
    try:  # an inferred pipeline axis: the [pipeline] section against its size
        check_pipeline(spec, dims.stages)
    except FieldError as err:
        raise UserInputError(f"{err.field}: {err} (mesh {dims.describe()})") from None
    return dims


def check_batch(spec: Spec, dims: ParallelDims, batch_axes: Sequence[str]) -> None:
    """The micro-batch must split evenly over the mesh axes that shard the batch dimension,
    and with a pipeline, each shard's part into the pipeline's micro-batches."""
    shards = dims.size_of(batch_axes)
    if spec.batch.micro % shards:
        raise UserInputError(
            f"batch.micro_batch: {spec.batch.micro} sequences per micro-batch are not divisible "
            f"by the {shards} batch shards of mesh axes {', '.join(batch_axes)}"
        )
    pipelined = pipeline_microbatches(spec, dims)
    if (spec.batch.micro // shards) % pipelined:
        raise UserInputError(
            f"batch.micro_batch: the {spec.batch.micro // shards} sequences of each of the "
            f"{shards} batch shards do not split into pipeline.microbatches = {pipelined}")


def pipeline_microbatches(spec: Spec, dims: ParallelDims) -> int:
    """Pipeline micro-batches per accumulation micro-batch: 1 without a pipeline, else the
    section's, by default one per stage."""
    if dims.stages == 1:
        return 1
    return spec.pipeline.microbatches or dims.stages


def usable_ids(spec: Spec, device_ids: Sequence[int]) -> list[int]:
    """`device_ids` less `mesh.exclude_devices`, in the given order."""
    excluded = set(spec.mesh.exclude_devices)
    unknown = excluded - set(device_ids)
    if unknown:
        raise UserInputError(
            f"mesh.exclude_devices names device ids {sorted(unknown)} that are not present"
        )
    return [d for d in device_ids if d not in excluded]


@dataclass(frozen=True)
class PlacedMesh:
    """Device ids (and the process of each) laid out in the resolved mesh shape."""

    dims: ParallelDims
    ids: np.ndarray        # int[*sizes]: the device id at each mesh position
    processes: np.ndarray  # int[*sizes]: the process holding that device

    def groups(self, axes: str | Sequence[str]) -> list[tuple[int, ...]]:
        """The device ids of each group a collective over `axes` spans.

        Within a group, members are ranked row-major over `axes` in the order given (as
        `lax.axis_index` ranks a tuple of axes); groups are listed row-major over the other axes.
        """
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        names = self.dims.names
        spanned = [names.index(a) for a in axes]
        other = [d for d in range(len(names)) if d not in spanned]
        moved = self.ids.transpose(other + spanned)
        n = math.prod(self.ids.shape[d] for d in spanned)
        return [tuple(int(i) for i in row) for row in moved.reshape(-1, n)]


def _process_blocks(dims: ParallelDims, ids: list[int], processes: list[int]) -> np.ndarray:
    """The hybrid grid: a `dcn`-shaped grid of processes (in process order), each block that
    process's devices in an `ici`-shaped grid."""
    order = sorted(set(processes))
    per_process = {p: [i for i, q in zip(ids, processes) if q == p] for p in order}
    counts = {len(v) for v in per_process.values()}
    if counts != {math.prod(dims.ici)}:
        raise UserInputError(
            f"mesh.axes: each process needs {math.prod(dims.ici)} devices for the ici "
            f"factors {dims.ici}, but the processes hold {sorted(counts)}"
        )
    grid = np.empty(dims.sizes, dtype=np.int64)
    blocks = np.arange(len(order)).reshape(dims.dcn)
    for block in itertools.product(*(range(d) for d in dims.dcn)):
        local = np.array(per_process[order[blocks[block]]]).reshape(dims.ici)
        where = tuple(slice(b * i, (b + 1) * i) for b, i in zip(block, dims.ici))
        grid[where] = local
    return grid


def place_devices(spec: Spec, device_ids: Sequence[int],
                  processes: Sequence[int] | None = None) -> PlacedMesh:
    """Lay out `device_ids` (less the excluded ones) in the spec's mesh.

    `processes[i]` is the process holding `device_ids[i]` (default: all in one process). With
    one process the ids fill the grid row-major in the given order.
    """
    processes = list(processes) if processes is not None else [0] * len(device_ids)
    process_of = dict(zip(device_ids, processes))
    ids = usable_ids(spec, list(device_ids))
    dims = resolve_mesh(spec, len(ids))
    n_processes = len({process_of[i] for i in ids})
    if math.prod(dims.dcn) > 1 and n_processes > 1:
        if n_processes != math.prod(dims.dcn):
            raise UserInputError(
                f"mesh.axes: dcn factors multiply to {math.prod(dims.dcn)}, but the devices "
                f"belong to {n_processes} processes"
            )
        grid = _process_blocks(dims, ids, [process_of[i] for i in ids])
    else:
        grid = np.array(ids, dtype=np.int64).reshape(dims.sizes)
    return PlacedMesh(dims, grid, np.vectorize(process_of.__getitem__, otypes=[np.int64])(grid))
