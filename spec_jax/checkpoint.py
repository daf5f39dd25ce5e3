"""Checkpoints of the whole run with orbax: save asynchronously, resume onto any mesh.

A checkpoint holds two items written together into one step directory:
- `state`: the train state (parameters, optimizer state, its step counter) as sharded arrays;
- `meta`: JSON with the step, the data position, the RNG, the spec and the run's length.

Atomicity comes from orbax: a step is written into `<step>.orbax-checkpoint-tmp*` and renamed to
`<step>` only once every item is complete, and orbax lists only renamed steps. On top of that a
step counts as good only when it restores: a directory that lists but does not read back (a
truncated copy, a foreign file) is skipped with a warning and the next older one is tried.

Resharding: restore targets an abstract state whose leaves carry the *current* job's shardings,
so a run saved on (data=4, fsdp=2) restores onto 4 devices, or onto (data=2, fsdp=4), directly.
The data position is the step: batches are a pure function of (seed, step) (data.py), so
resuming at step S on any mesh continues with exactly batch S, none seen twice or skipped.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from spec_jax.core.errors import UserInputError
from spec_jax.core.spec import Spec

log = logging.getLogger(__name__)

FORMAT = 1
# The sections that define the computation: resuming under a different one would silently
# train another model. Placement (mesh, layout, collectives) and bookkeeping may change.
MUST_MATCH = ("seed", "model", "optimizer", "batch", "precision")


def _first_difference(saved: Any, current: Any, path: str) -> tuple[str, Any, Any] | None:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            diff = _first_difference(saved.get(key), current.get(key), f"{path}.{key}")
            if diff:
                return diff
        return None
    return None if saved == current else (path, saved, current)


def check_compatible(saved: dict, spec: Spec, where: Path) -> None:
    """Raise UserInputError naming the first computation-defining field that changed."""
    current = spec.to_dict()
    for section in MUST_MATCH:
        diff = _first_difference(saved.get(section), current.get(section), section)
        if diff:
            field, was, now = diff
            raise UserInputError(
                f"{field}: the checkpoints in {where} were written with {was!r}, the spec says "
                f"{now!r}; use a new --run-dir, or the saved value"
            )


def abstract_like(state):
    """Shape, dtype and sharding of each leaf: the target orbax restores (and reshards) into.
    `state` may be concrete arrays or already abstract (ShapeDtypeStructs with shardings)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


class Checkpointer:
    """Checkpoints of one run directory (`checkpoint.dir` inside it), per the spec."""

    def __init__(self, spec: Spec, run_dir: Path):
        self.spec = spec
        self.interval = spec.checkpoint.interval
        self.directory = (Path(run_dir) / spec.checkpoint.dir).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=spec.checkpoint.keep,
            enable_async_checkpointing=spec.checkpoint.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )
        self.last_saved: int | None = self.manager.latest_step()

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def due(self, step: int, last_step: int) -> bool:
        return self.enabled and (step % self.interval == 0 or step == last_step)

    # -- save ---------------------------------------------------------------------------------
    def save(self, step: int, state, total_steps: int, skipped_steps: int = 0) -> None:
        """Start writing `state` as of `step` (steps done = next batch index); returns at once
        when `checkpoint.async_save`. The previous save is finished first (orbax)."""
        if not self.enabled or step == self.last_saved:
            return
        meta = {
            "format": FORMAT,
            "step": step,
            "data_position": step,  # index of the next batch: data.batch(step)
            # The reference job draws randomness only at init (key(seed)); kept so a job that
            # folds the step into it per step resumes its stream exactly.
            "rng": np.asarray(jax.random.key_data(jax.random.key(self.spec.seed))).tolist(),
            "total_steps": total_steps,
            "skipped_steps": skipped_steps,
            "spec": self.spec.to_dict(),
        }
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        )
        self.last_saved = step

    def wait(self) -> None:
        """Block until the background save (if any) is complete and renamed into place."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    # -- restore ------------------------------------------------------------------------------
    def good_steps(self) -> list[int]:
        """Finalized steps, newest first (unfinished `*.orbax-checkpoint-tmp*` never appear)."""
        self.manager.reload()
        return sorted(self.manager.all_steps(), reverse=True)

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore(self, step: int, target):
        """(state, meta) of `step`, resharded onto the shardings of `target` (see abstract_like).

        The meta is read and checked first: a checkpoint of another model must be reported as
        such (UserInputError), not fail as an unreadable state."""
        meta = self.read_meta(step)
        if meta.get("format") != FORMAT or meta.get("step") != step:
            raise ValueError(f"meta of step {step} is not a trainspec v{FORMAT} checkpoint")
        check_compatible(meta["spec"], self.spec, self.directory)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_like(target))))
        return restored.state, meta

    def restore_latest(self, target) -> tuple[Any, dict | None]:
        """The newest good checkpoint resharded like `target`, or (None, None) when there is
        none. `target` carries the current job's shardings: the abstract state its step
        planned, so that nothing is initialised only to be overwritten."""
        for step in self.good_steps():
            try:
                state, meta = self.restore(step, target)
            except UserInputError:
                raise
            except Exception as err:  # noqa: BLE001  unreadable = not good; try the older one
                log.warning("checkpoint %d in %s is unreadable, trying an older one: %s",
                            step, self.directory, str(err).splitlines()[0][:200])
                continue
            self.last_saved = step
            return state, meta
        return None, None

    def saved_total_steps(self) -> int | None:
        """The run length the newest good checkpoint was planned for (its LR schedule), if any."""
        for step in self.good_steps():
            try:
                meta = self.read_meta(step)
            except Exception:  # noqa: BLE001  same rule as restore_latest
                continue
            check_compatible(meta["spec"], self.spec, self.directory)
            return int(meta["total_steps"])
        return None
