"""One checkpoint written in the background (trainspec.torch.checkpoint, `checkpoint.async_save`):
DCP's `async_save` copies the state to host memory before it returns (so the step may change
its tensors in place), and writes it from a thread of its own; a second thread here waits for
that write and then runs the checkpoint's completion (every rank's shards on disk, then rank 0
marks it good), so that a checkpoint is complete as soon as it is written rather than when
the loop next asks."""
from __future__ import annotations

import atexit
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

        # A daemon that a process leaving normally waits for (atexit): a loop of the user's
        # that ends without `wait()` still completes its last save, rather than aborting in
        # the middle of the save's collectives. Every rank's save runs on the save group
        # alone, so it completes even where this rank's loop died of an exception; where
        # another rank died, it fails at the group's timeout, never marked good.
        self._thread = threading.Thread(target=finish, name="trainspec-checkpoint", daemon=True)
        self._thread.start()
        atexit.register(self._thread.join)

    def wait(self) -> None:
        self._thread.join()
        atexit.unregister(self._thread.join)
        if self._error is not None:
            raise self._error
