"""Spec -> jax.sharding.Mesh: resolve axis sizes against the devices, then lay the devices out.

ICI (within a process) and DCN (across processes) factors are kept apart so that an axis that
spans hosts puts its cross-host part on the slow links only (MaxText's hybrid mesh).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from spec_jax.errors import UserInputError
from spec_jax.spec import Spec


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
        return " x ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))


def usable_devices(spec: Spec, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    devices = list(jax.devices() if devices is None else devices)
    excluded = set(spec.mesh.exclude_devices)
    unknown = excluded - {d.id for d in devices}
    if unknown:
        raise UserInputError(
            f"mesh.exclude_devices names device ids {sorted(unknown)} that are not present"
        )
    return [d for d in devices if d.id not in excluded]


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


def process_grid(mesh: Mesh) -> np.ndarray:
    """The process index of each device of `mesh`, laid out like the mesh."""
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def check_hierarchical(spec: Spec, mesh: Mesh) -> None:
    """`collectives.backend = "hierarchical"` reduces over the in-process and the cross-process
    part of the data axes in separate stages, so each data axis must lie either inside one
    process or entirely across processes (every step along it changes process)."""
    if spec.collectives.backend != "hierarchical":
        return
    procs = process_grid(mesh)
    for i, name in enumerate(mesh.axis_names):
        size = mesh.devices.shape[i]
        if name not in spec.mesh.axes_with_role("data") or size == 1:
            continue
        along = np.moveaxis(procs, i, -1).reshape(-1, size)
        distinct = {len(set(row)) for row in along.tolist()}
        if distinct not in ({1}, {size}):
            raise UserInputError(
                f"mesh.axes.{name}: collectives.backend = \"hierarchical\" needs the "
                f"cross-process part of a data axis as an axis of its own, but '{name}' "
                f"(size {size}) spans several processes and several devices in each; split it, "
                f"e.g. mesh.axes.replica = {{role = \"data\", size = P, dcn = P}} before "
                f"mesh.axes.{name} = {{size = -1}} for P processes (docs/scale-out.md)"
            )


def build_mesh(spec: Spec, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The spec's mesh over `devices` (default: all devices, less `mesh.exclude_devices`)."""
    devices = usable_devices(spec, devices)
    resolved = resolve_mesh(spec, len(devices))
    n_processes = len({d.process_index for d in devices})
    # In one process the dcn factors are laid out within it (docs/spec.md): a multi-host spec
    # runs unchanged, and computes the same, on one machine.
    if math.prod(resolved.dcn) > 1 and n_processes > 1:
        if n_processes != math.prod(resolved.dcn):
            raise UserInputError(
                f"mesh.axes: dcn factors multiply to {math.prod(resolved.dcn)}, but the devices "
                f"belong to {n_processes} processes"
            )
        grid = mesh_utils.create_hybrid_device_mesh(
            resolved.ici, resolved.dcn, devices, process_is_granule=True
        )
    elif len(devices) == len(jax.devices()):
        grid = mesh_utils.create_device_mesh(resolved.sizes, devices)
    else:  # a subset (exclusion, tests): keep the given order, no topology to optimise on CPU
        grid = np.array(devices).reshape(resolved.sizes)
    return Mesh(grid, resolved.names)

