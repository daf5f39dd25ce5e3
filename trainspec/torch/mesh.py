"""The spec's mesh on torch: the spec's axes as a DeviceMesh of the job's ranks (one device per
rank), with the same names and sizes, in the same (row-major) order, as the JAX mesh, so rank r
sits where device r sits there; and the process group over some of its axes."""
from __future__ import annotations

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from trainspec.core.mesh import place_devices
from trainspec.core.spec import Spec
from trainspec.torch.support import excluding


def device_mesh(spec: Spec, device_type: str, hosts: list[int]) -> DeviceMesh:
    """The DeviceMesh of a job whose rank r runs on host `hosts[r]` (rank_grid)."""
    return DeviceMesh(device_type, torch.from_numpy(rank_grid(spec, hosts)),
                      mesh_dim_names=tuple(spec.mesh.axes))


def rank_grid(spec: Spec, hosts: list[int]) -> np.ndarray:
    """The rank at each position of the spec's mesh, for a job whose rank r runs on host
    `hosts[r]` (ranks numbered host by host, as torchrun and trainspec launch number them): on
    one host row-major, the dcn factors laid out within it; on several, the core's hybrid
    layout (trainspec.core.mesh.place_devices): a dcn-shaped grid of hosts, each host's ranks
    in the ici shape, so an axis that spans hosts puts only its dcn part across them.
    `mesh.exclude_devices` is not applied: they already left the job (trainspec.torch.members)."""
    return place_devices(excluding(spec, []), list(range(len(hosts))), hosts).ids


def group_of(mesh: DeviceMesh, axes: tuple[str, ...]):
    """The process group spanning mesh axes `axes` (row-major, like a JAX axis tuple)."""
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    return mesh[axes]._flatten().get_group()
