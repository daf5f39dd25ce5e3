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
from trainspec.core.spec import Spec


def mesh_text(shape: Mapping[str, int]) -> str:
    """A mesh as messages and records name it: 'data=8 x fsdp=1 x tensor=1'."""
    return " x ".join(f"{name}={size}" for name, size in shape.items())


@dataclass(frozen=True)
class ResolvedMesh:
    """Axis sizes with -1 resolved: total = ici * dcn per axis, in spec order."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    dcn: tuple[int, ...]

    @property
    def ici(self) -> tuple[int, ...]:
        return tuple(s // d for s, d in zip(self.sizes, self.dcn))

    def size_of(self, axes: Sequence[str]) -> int:
        return math.prod(self.sizes[self.names.index(a)] for a in axes)

    def describe(self) -> str:
        return mesh_text(dict(zip(self.names, self.sizes)))


def resolve_mesh(spec: Spec, n_devices: int) -> ResolvedMesh:
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
    dcn = tuple(a.dcn for a in spec.mesh.axes.values())
    return ResolvedMesh(names, tuple(sizes), dcn)


def check_batch(spec: Spec, resolved: ResolvedMesh, batch_axes: Sequence[str]) -> None:
    """The micro-batch must split evenly over the mesh axes that shard the batch dimension."""
    shards = resolved.size_of(batch_axes)
    if spec.batch.micro % shards:
        raise UserInputError(
            f"batch.micro_batch: {spec.batch.micro} sequences per micro-batch are not divisible "
            f"by the {shards} batch shards of mesh axes {', '.join(batch_axes)}"
        )


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

    resolved: ResolvedMesh
    ids: np.ndarray        # int[*sizes]: the device id at each mesh position
    processes: np.ndarray  # int[*sizes]: the process holding that device

    def groups(self, axes: str | Sequence[str]) -> list[tuple[int, ...]]:
        """The device ids of each group a collective over `axes` spans.

        Within a group, members are ranked row-major over `axes` in the order given (as
        `lax.axis_index` ranks a tuple of axes); groups are listed row-major over the other axes.
        """
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        names = self.resolved.names
        dims = [names.index(a) for a in axes]
        other = [d for d in range(len(names)) if d not in dims]
        moved = self.ids.transpose(other + dims)
        n = math.prod(self.ids.shape[d] for d in dims)
        return [tuple(int(i) for i in row) for row in moved.reshape(-1, n)]


def _process_blocks(resolved: ResolvedMesh, ids: list[int], processes: list[int]) -> np.ndarray:
    """The hybrid grid: a `dcn`-shaped grid of processes (in process order), each block that
    process's devices in an `ici`-shaped grid."""
    order = sorted(set(processes))
    per_process = {p: [i for i, q in zip(ids, processes) if q == p] for p in order}
    counts = {len(v) for v in per_process.values()}
    if counts != {math.prod(resolved.ici)}:
        raise UserInputError(
            f"mesh.axes: each process needs {math.prod(resolved.ici)} devices for the ici "
            f"factors {resolved.ici}, but the processes hold {sorted(counts)}"
        )
    grid = np.empty(resolved.sizes, dtype=np.int64)
    blocks = np.arange(len(order)).reshape(resolved.dcn)
    for block in itertools.product(*(range(d) for d in resolved.dcn)):
        local = np.array(per_process[order[blocks[block]]]).reshape(resolved.ici)
        where = tuple(slice(b * i, (b + 1) * i) for b, i in zip(block, resolved.ici))
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
    resolved = resolve_mesh(spec, len(ids))
    n_processes = len({process_of[i] for i in ids})
    if math.prod(resolved.dcn) > 1 and n_processes > 1:
        if n_processes != math.prod(resolved.dcn):
            raise UserInputError(
                f"mesh.axes: dcn factors multiply to {math.prod(resolved.dcn)}, but the devices "
                f"belong to {n_processes} processes"
            )
        grid = _process_blocks(resolved, ids, [process_of[i] for i in ids])
    else:
        grid = np.array(ids, dtype=np.int64).reshape(resolved.sizes)
    return PlacedMesh(resolved, grid, np.vectorize(process_of.__getitem__, otypes=[np.int64])(grid))
