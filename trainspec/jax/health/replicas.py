"""Replica fingerprints: catch silent data corruption by comparing the copies of each shard.

Every array of the train state is either split over a mesh axis or replicated along it; along
the replicated axes (the data axes, for parameters) several devices hold the same shard and must
hold the same bytes. Each device fingerprints each of its local shards on device with the
xla_ext handler (a `shard_map` over the whole mesh, so every device hashes its own buffer, not a
copy the compiler might have deduplicated), which gives uint32[mesh..., leaves, 2]: 8 bytes per
shard. Only that small array crosses to the host, where copies of the same shard are compared.
The vote (trainspec.core.health.diverged_copies) names the odd one out, against the majority of
its copies, with its replica index and device; with only two copies there is no majority, and
both are named.

Megatron-LM hashes parameters on the CPU and gathers the hashes (slow, so every 20000 steps);
on-device fingerprints cost about one read of the state, so they can run every 100 steps
(bench/fingerprint_overhead.py measures it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainspec.jax import layout
from trainspec.core.health import Divergence, diverged_copies
from trainspec.jax.fingerprint import fingerprint


class ReplicaFingerprints:
    """Fingerprint every device's shards of a state laid out on `mesh`; find diverged copies."""

    def __init__(self, mesh: Mesh, data_axes: tuple[str, ...]):
        self.mesh, self.data_axes = mesh, data_axes
        self._fn = None

    def _build(self, state):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        self.paths = [jax.tree_util.keystr(p) for p, _ in leaves]
        self.pspecs = [x.sharding.spec for _, x in leaves]
        mesh_axes = self.mesh.axis_names

        def local(*shards):  # runs on every device over its own buffers
            fps = jnp.stack([fingerprint(s) for s in shards])  # (leaves, 2)
            return fps.reshape((1,) * len(mesh_axes) + fps.shape)

        mapped = jax.shard_map(
            local, mesh=self.mesh, in_specs=tuple(self.pspecs), out_specs=P(*mesh_axes),
            check_vma=False,  # the custom call is opaque to the replication checker
        )
        return jax.jit(lambda s: mapped(*jax.tree.leaves(s)))

    def fingerprints(self, state) -> np.ndarray:
        """uint32[*mesh.shape, leaves, 2]: each device's fingerprint of each of its shards."""
        if self._fn is None:
            self._fn = self._build(state)
        fps = self._fn(state)
        if jax.process_count() > 1:  # the other processes' devices: fetch the whole array
            return np.asarray(multihost_utils.process_allgather(fps, tiled=True))
        return np.asarray(fps)

    def compare(self, fps: np.ndarray) -> list[Divergence]:
        """Copies of the same shard that differ from the majority of their copies."""
        ids = np.vectorize(lambda d: d.id)(self.mesh.devices)
        leaves = [(path, layout.mesh_axes_of(pspec)) for path, pspec in zip(self.paths, self.pspecs)]
        return diverged_copies(fps, ids, self.mesh.axis_names, leaves, self.data_axes)

    def check(self, state) -> list[Divergence]:
        return self.compare(self.fingerprints(state))


def flip_bit(x: jax.Array, device_id: int, flat_index: int = 0, bit: int = 0) -> jax.Array:
    """`x` with one bit flipped in the copy held by one device only: a simulated SDC.

    The global array is rebuilt from its per-device buffers, so every other copy is untouched.
    """
    shards = []
    for s in x.addressable_shards:
        data = np.array(s.data)
        if s.device.id == device_id:
            raw = data.reshape(-1).view(np.uint8 if data.dtype.itemsize == 1 else f"u{data.dtype.itemsize}")
            raw[flat_index] ^= raw.dtype.type(1 << bit)
        shards.append(jax.device_put(data, s.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
