"""One checkpoint written in the background (trainspec.torch.checkpoint, `checkpoint.async_save`):
the state was copied to host memory before (so the step may change its tensors in place); a
thread here writes this rank's file and then runs the checkpoint's completion (every rank's
file on disk, then rank 0 seals it), so that a checkpoint is complete as soon as it is written
rather than when the loop next asks."""
from __future__ import annotations

import atexit
import threading
from collections.abc import Callable


class BackgroundSave:
    """`write()`, then `complete(group)`, in a thread; `wait()` joins it and raises what failed
    in the background."""

    def __init__(self, write: Callable[[], None], group, complete: Callable):
        self._error: BaseException | None = None

        def finish() -> None:
            try:
                write()
                complete(group)
            except BaseException as err:  # raised again in the loop's thread, by wait()
                self._error = err

        # A daemon that a process leaving normally waits for (atexit): a loop of the user's
        # that ends without `wait()` still completes its last save, rather than aborting in
        # the middle of the save's collectives. Every rank's save runs on the save group
        # alone, so it completes even where this rank's loop died of an exception; where
        # another rank died, it fails at the group's timeout, never sealed.
        self._thread = threading.Thread(target=finish, name="trainspec-checkpoint", daemon=True)
        self._thread.start()
        atexit.register(self._thread.join)

    def wait(self) -> None:
        self._thread.join()
        atexit.unregister(self._thread.join)
        if self._error is not None:
            raise self._error
