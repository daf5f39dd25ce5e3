"""One checkpoint written in the background (trainspec.torch.checkpoint, `checkpoint.async_save`):
DCP's `async_save` copies the state to host memory before it returns (so the step may change
its tensors in place), and writes it from a thread of its own; a second thread here waits for
that write and then runs the checkpoint's completion (every rank's shards on disk, then rank 0
marks it good), so that a checkpoint is complete as soon as it is written rather than when
the loop next asks."""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch.distributed.checkpoint as dcp


class BackgroundSave:
    """`state` saved to `directory` over `group`, then `complete(group)`; `wait()` joins it and
    raises what failed in the background."""

    def __init__(self, state: dict, directory: Path, group, complete: Callable):
        self._error: BaseException | None = None
        written = dcp.async_save(state, checkpoint_id=str(directory), process_group=group)

        def finish() -> None:
            try:
                written.result()
                complete(group)
            except BaseException as err:  # raised again in the loop's thread, by wait()
                self._error = err

        # A daemon: a process that dies (an exception on this rank) must not hang on a
        # barrier the other ranks never reach; its half-written save is never marked good.
        self._thread = threading.Thread(target=finish, name="trainspec-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
