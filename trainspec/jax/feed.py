"""This process's rows of each step's batch, as the reference job's loop takes them."""
from __future__ import annotations

import time

import jax

from trainspec.core.errors import UserInputError
from trainspec.jax.health.memory import check_host_batch


def local_rows(job) -> slice:
    """This process's rows of the global batch: the rows its devices hold under the batch
    sharding (not "block p of P": which rows a process holds follows the mesh and the layout).
    They must be one contiguous block of whole sequences, the form the data source builds and
    `jax.make_array_from_process_local_data` takes."""
    spec = job.spec
    shape = (spec.batch.global_batch, spec.batch.seq_len)
    held = job.step.batch_sharding(2).addressable_devices_indices_map(shape).values()
    rows, cols = set(), set()
    for index in held:
        rows.update(range(*index[0].indices(shape[0])[:2]))
        cols.update(range(*index[1].indices(shape[1])[:2]))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo or len(cols) != shape[1]:
        raise UserInputError(
            f"layout.rules.batch: process {jax.process_index()} holds {len(rows)} rows of the "
            f"batch between {lo} and {hi} and {len(cols)} of {shape[1]} positions, not one "
            "contiguous block of whole sequences; list the cross-process mesh axes first in "
            "the batch rule and do not split `length` across processes")
    return slice(lo, hi)


class Feed:
    """This process's rows of each step's batch of a job (trainspec.jax.train.Job). The first batch
    is fetched at once: the metrics logger compiles the step with it, and the first step then
    uses it (each batch is fetched exactly once)."""

    def __init__(self, job, position: int):
        self.data, self.rows = job.data, local_rows(job)
        self.host_bytes = self.data.host_bytes(self.rows.stop - self.rows.start)
        check_host_batch(self.host_bytes)  # before the batch takes the memory
        self.first = self._prefetched = self.data.batch(position, self.rows)

    def batch(self, index: int):
        """(batch `index`, seconds the host waited for it)."""
        t0 = time.perf_counter()
        host_batch = self._prefetched if self._prefetched is not None else self.data.batch(index, self.rows)
        self._prefetched = None
        return host_batch, time.perf_counter() - t0
