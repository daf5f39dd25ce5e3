"""A step's batch, placed where the spec's layout wants it and checked against the spec.

The checks (rows against `batch.global_batch`, token arrays against `batch.seq_len`) run once
per batch structure and shapes, not per step; the placement is one `device_put` of the whole
batch in a single process, which also moves arrays committed elsewhere (e.g. to one device).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from trainspec.jax import layout
from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec


def _is_token_array(x) -> bool:
    """Integer or boolean arrays of rank 2 are (batch, length): token ids, masks, positions."""
    dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)  # no fetch
    return np.ndim(x) == 2 and (np.issubdtype(dtype, np.integer) or dtype == np.bool_)


class BatchPlacement:
    """Puts host batches (this process's rows) or arrays on any devices onto the batch sharding."""

    def __init__(self, spec: Spec, mesh: Mesh):
        self.spec, self.mesh = spec, mesh
        self.single_process = jax.process_count() == 1
        self._checked: dict = {}  # (treedef, leaf shapes) -> shardings tree, once checked
        self._by_ndim: dict[int, NamedSharding] = {}

    def sharding(self, ndim: int) -> NamedSharding:
        if ndim not in self._by_ndim:
            pspec = layout.batch_partition_spec(self.spec, self.mesh, ndim)
            self._by_ndim[ndim] = NamedSharding(self.mesh, pspec)
        return self._by_ndim[ndim]

    def _local_rows(self, sharding: NamedSharding) -> int:
        """Rows of the global batch that this process's devices hold."""
        held = sharding.addressable_devices_indices_map((self.spec.batch.global_batch,))
        return len({r for index in held.values()
                    for r in range(*index[0].indices(self.spec.batch.global_batch)[:2])})

    def _check(self, leaves_with_path, shardings) -> None:
        batch = self.spec.batch
        for (path, x), sharding in zip(leaves_with_path, shardings):
            name = f"batch{jax.tree_util.keystr(path)}"
            if np.ndim(x) == 0:
                raise UserInputError(
                    f"batch.global_batch: {name} is a scalar; every batch array needs a leading "
                    f"dimension of batch.global_batch = {batch.global_batch} rows")
            is_global = isinstance(x, jax.Array) and not x.is_fully_addressable
            rows = batch.global_batch
            if not (self.single_process or is_global):
                rows = self._local_rows(sharding)
            if np.shape(x)[0] != rows:
                where = "" if rows == batch.global_batch else f" ({rows} on this process)"
                raise UserInputError(
                    f"batch.global_batch: {name} has {np.shape(x)[0]} rows, but the spec's "
                    f"batch.global_batch is {batch.global_batch}{where}; pass whole global "
                    "batches or change batch.global_batch")
            if _is_token_array(x) and np.shape(x)[1] != batch.seq_len:
                raise UserInputError(
                    f"batch.seq_len: {name} is a (batch, length) token array of length "
                    f"{np.shape(x)[1]}, but the spec's batch.seq_len is {batch.seq_len}")

    def shardings(self, batch):
        """The batch's shardings (a tree like `batch`), checking its shapes the first time."""
        leaves, treedef = jax.tree.flatten(batch)
        key = (treedef, tuple(np.shape(x) for x in leaves))
        shardings = self._checked.get(key)
        if shardings is None:
            shardings = [self.sharding(np.ndim(x)) for x in leaves]
            self._check(jax.tree_util.tree_leaves_with_path(batch), shardings)
            shardings = self._checked[key] = treedef.unflatten(shardings)
        return shardings

    def place(self, batch):
        """Global arrays on the batch sharding, from host arrays or arrays on any devices."""
        shardings = self.shardings(batch)
        if self.single_process:  # one transfer for the whole tree; a no-op for placed arrays
            return jax.device_put(batch, shardings)
        return jax.tree.map(self._place_process_local, batch, shardings)

    @staticmethod
    def _place_process_local(x, sharding: NamedSharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding == sharding else jax.device_put(x, sharding)
        # This process's rows, from the host or from one of its devices.
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))
