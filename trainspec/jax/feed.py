"""This process's rows of each step's batch (of a WrappedStep), as the run loop takes them."""
from __future__ import annotations

import jax

from trainspec.core.errors import UserInputError


def local_rows(step) -> slice:
    """This process's rows of the global batch: the rows its devices hold under the batch
    sharding (not "block p of P": which rows a process holds follows the mesh and the layout).
    They must be one contiguous block of whole sequences, the form the data source builds and
    `jax.make_array_from_process_local_data` takes."""
    spec = step.spec
    shape = (spec.batch.global_batch, spec.batch.seq_len)
    held = step.batch_sharding(2).addressable_devices_indices_map(shape).values()
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
