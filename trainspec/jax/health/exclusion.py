"""Device exclusion: rebuild the mesh without bad devices, as large as the spec allows
(trainspec.core.exclusion says which devices and why): the largest n of the usable devices for
which the spec still resolves and the micro-batch still splits evenly is used, the rest idle.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from trainspec.jax import layout
from trainspec.core.errors import UserInputError
from trainspec.core.exclusion import first_that_fits, prefixes
from trainspec.core.mesh import ParallelDims, check_batch
from trainspec.jax.mesh import build_mesh, usable_devices
from trainspec.core.spec import Spec


def _checked_mesh(spec: Spec, devices: Sequence[jax.Device]) -> Mesh:
    mesh = build_mesh(spec, devices)
    check_batch(spec, ParallelDims.of(spec, mesh.shape), layout.batch_axes(spec, mesh))
    return mesh


def _candidates(usable: Sequence[jax.Device]) -> list[list[jax.Device]]:
    """Device sets to try, largest first. One process: the prefixes of its usable devices.
    Several: the first k usable devices of every process, for each k, since each process runs
    the same program on its own devices (a process left without any could not take part) and a
    multi-host mesh is one equal block per process."""
    by_process: dict[int, list[jax.Device]] = {}
    for d in usable:
        by_process.setdefault(d.process_index, []).append(d)
    if len(by_process) == 1:
        return prefixes(usable)
    most = min(len(ds) for ds in by_process.values())
    return [[d for ds in by_process.values() for d in ds[:k]] for k in range(most, 0, -1)]


def largest_mesh(spec: Spec, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The spec's mesh over the largest set of the usable devices that satisfies it
    (`_candidates`: a prefix, or the same number from every process).

    Without excluded devices this is `build_mesh` (a spec that does not fit all devices is the
    user's error, reported as such, never silently shrunk). With exclusions, if no set fits,
    the error is the one for the largest.
    """
    if not spec.mesh.exclude_devices:
        return _checked_mesh(spec, list(jax.devices() if devices is None else devices))
    usable = usable_devices(spec, devices)
    # build_mesh applies exclude_devices itself; the candidates are already filtered
    unfiltered = spec.model_copy(update={"mesh": spec.mesh.model_copy(update={"exclude_devices": []})})
    if not usable:
        raise UserInputError(f"mesh.exclude_devices: all {len(spec.mesh.exclude_devices)} devices are excluded")
    return first_that_fits(_candidates(usable), lambda devices: _checked_mesh(unfiltered, devices))
