"""NCCL for the `ext` backend's CUDA handlers: the library, loaded at run time, and one
communicator per group of devices that an ext collective spans.

NCCL comes from the nvidia-nccl wheel (nvidia-nccl-cu13, or -cu12) where one is installed, else
the system's libnccl.so.2; a CPU install needs neither. A communicator is made the first time a
(mesh, axes) pair is traced: for each group (the devices that differ only along `axis_names`),
the process of the group's rank 0 makes NCCL's unique id and passes it to the group's other
processes through jax.distributed's key-value store; every process then joins all its local
members at once (xla_ext/cuda/nccl_comms.h), under collectives.timeout_s. Every process traces
the same collectives in the same order (SPMD), so the communicators get the same ids everywhere.
"""
from __future__ import annotations

import importlib.metadata
import itertools
import math
import threading

import numpy as np

from trainspec.jax import xla_ext

_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
_KEY_PREFIX = "trainspec_nccl"

_lock = threading.Lock()
_communicators: dict[tuple, int] = {}
_ids = itertools.count()


def library_path() -> str:
    """libnccl.so.2 of an installed nvidia-nccl wheel, else the name for the system's loader."""
    for wheel in _WHEELS:
        try:
            dist = importlib.metadata.distribution(wheel)
        except importlib.metadata.PackageNotFoundError:
            continue
        found = dist.locate_file("nvidia/nccl/lib/libnccl.so.2")
        if found.exists():
            return str(found)
    return "libnccl.so.2"


def load() -> int:
    """Loads NCCL (once); returns its version code, e.g. 23206."""
    return xla_ext.cuda_module().nccl_load(library_path())


def groups(devices: np.ndarray, axis_names: tuple[str, ...], mesh_axes: tuple[str, ...]):
    """The groups of `devices` (shaped like the mesh) along `axis_names`: a list, indexed by the
    group id ext passes (row-major over the other axes), of the group's devices in rank order
    (row-major over axis_names, like lax.axis_index)."""
    along = [mesh_axes.index(a) for a in axis_names]
    others = [i for i in range(len(mesh_axes)) if i not in along]
    arranged = np.transpose(devices, others + along)
    n = math.prod(devices.shape[i] for i in along)
    return [list(row) for row in arranged.reshape(-1, n)]


def _unique_ids(comm_id: int, group_list, timeout_s: float) -> dict[int, bytes]:
    """The unique id of every group this process has a member of."""
    import jax
    from jax._src import distributed  # the key-value store has no public accessor in jax 0.10

    me = jax.process_index()
    client = distributed.global_state.client
    ids = {}
    for g, members in enumerate(group_list):
        leader = members[0].process_index
        if leader == me:
            ids[g] = xla_ext.cuda_module().nccl_unique_id()
            if client is not None and any(d.process_index != me for d in members):
                client.key_value_set(f"{_KEY_PREFIX}/{comm_id}/{g}", ids[g].hex())
        elif any(d.process_index == me for d in members):
            value = client.blocking_key_value_get(f"{_KEY_PREFIX}/{comm_id}/{g}",
                                                  int(timeout_s * 1000))
            ids[g] = bytes.fromhex(value)
    return ids


def communicator(mesh, axis_names: tuple[str, ...], timeout_s: float) -> int:
    """The id of the communicators of `mesh`'s groups along `axis_names`, made on first use."""
    import jax

    key = (tuple(d.id for d in mesh.devices.flat), tuple(mesh.axis_names), tuple(axis_names))
    with _lock:
        if key in _communicators:
            return _communicators[key]
        load()
        comm_id = next(_ids)
        group_list = groups(mesh.devices, tuple(axis_names), tuple(mesh.axis_names))
        ids = _unique_ids(comm_id, group_list, timeout_s)
        me = jax.process_index()
        members = [(d.local_hardware_id, rank, len(group), ids[g])
                   for g, group in enumerate(group_list)
                   for rank, d in enumerate(group) if d.process_index == me]
        xla_ext.cuda_module().nccl_create(comm_id, members, max(1, round(timeout_s * 1000)))
        _communicators[key] = comm_id
        return comm_id
