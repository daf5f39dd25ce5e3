"""Spec -> jax.sharding.Mesh: the core's placement (trainspec.core.mesh) over jax devices.

The core resolves the axis sizes and lays device ids out (hybrid ici/dcn blocks across
processes); here those ids become `jax.Device`s. On accelerators with a physical topology,
jax's mesh_utils orders the devices of the whole machine instead.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from trainspec.core.errors import UserInputError
from trainspec.core.mesh import place_devices, usable_ids
from trainspec.core.spec import Spec
from trainspec.jax.backends import backend


def process_grid(mesh: Mesh) -> np.ndarray:
    """The process index of each device of `mesh`, laid out like the mesh."""
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def users_mesh(spec: Spec, mesh: Mesh) -> Mesh:
    """A mesh given to `wrap`, as the step runs on it: the same devices and axis names, every
    axis `Auto` (the step places arrays by shardings and constraints, which on an `Explicit`
    axis, `jax.make_mesh`'s default, are assertions). Its axes must be the spec's, no more and
    no fewer: the layout rules map logical axes onto those names, and an axis the spec does not
    know would replicate everything over it unseen."""
    if set(mesh.axis_names) != set(spec.mesh.axes):
        raise UserInputError(
            f"mesh: its axes ({', '.join(mesh.axis_names)}) are not the spec's mesh.axes "
            f"({', '.join(spec.mesh.axes)}); build it with trainspec.jax.build_mesh(spec, devices), "
            "or pass devices= instead of a mesh")
    return Mesh(mesh.devices, mesh.axis_names,
                axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def check_hierarchical(spec: Spec, mesh: Mesh) -> None:
    """A backend that reduces over the in-process and the cross-process part of the data axes
    in separate stages (`collectives.backend = "hierarchical"`) needs each data axis either
    inside one process or entirely across processes (every step along it changes process)."""
    if not backend(spec.collectives.backend).splits_at_processes:
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


def usable_devices(spec: Spec, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    devices = list(jax.devices() if devices is None else devices)
    usable = set(usable_ids(spec, [d.id for d in devices]))
    return [d for d in devices if d.id in usable]


def build_mesh(spec: Spec, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The spec's mesh over `devices` (default: all devices, less `mesh.exclude_devices`)."""
    devices = list(jax.devices() if devices is None else devices)
    placed = place_devices(spec, [d.id for d in devices], [d.process_index for d in devices])
    dims = placed.dims
    if devices[0].platform != "cpu" and placed.ids.size == len(jax.devices()):
        # The whole machine: let jax order it by its physical topology (ICI rings, NVLink).
        usable = usable_devices(spec, devices)
        if math.prod(dims.dcn) > 1 and len({d.process_index for d in usable}) > 1:
            grid = mesh_utils.create_hybrid_device_mesh(
                dims.ici, dims.dcn, usable, process_is_granule=True)
        else:
            grid = mesh_utils.create_device_mesh(dims.sizes, usable)
    else:
        by_id = {d.id: d for d in devices}
        grid = np.vectorize(by_id.__getitem__, otypes=[object])(placed.ids)
    return Mesh(grid, dims.names)
