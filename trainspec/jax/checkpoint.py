"""Checkpoints of the whole run with orbax: save asynchronously, resume onto any mesh.

A checkpoint holds two items written together into one step directory:
- `state`: the train state (parameters, optimizer state, its step counter) as sharded arrays;
- `meta`: JSON with the step, the data position, the RNG, the spec, the mesh the state was
  sharded over (a resume says from which mesh it came) and the run's length.

Atomicity comes from orbax: a step is written into `<step>.orbax-checkpoint-tmp*` and renamed to
`<step>` only once every item is complete, and orbax lists only renamed steps.

Verified, not trusted: the meta holds a content checksum of every array (trainspec.jax.checksum),
taken when the state is saved and recomputed on the restored arrays. A step that does not read
back (truncated or deleted files, a foreign file) or whose arrays differ from their checksums
(a flipped bit, overwritten bytes) is bad: the newest good step is restored instead, with one
line naming the bad one and why, and the bad ones are moved aside into `<dir>-quarantine/`
(kept, not deleted), so the re-trained steps take their place. When no step is good the run
stops (UserInputError) and leaves them all in place; starting over is explicit (`set_aside`).

Resharding: restore targets an abstract state whose leaves carry the *current* job's shardings,
so a run saved on (data=4, fsdp=2) restores onto 4 devices, or onto (data=2, fsdp=4), directly.
The data position is the step: batches are a pure function of (seed, step) (data.py), so
resuming at step S on any mesh continues with exactly batch S, none seen twice or skipped.
A compressed run's error-feedback residuals (one per data-parallel replica) are read back as
saved and, onto another replica count, folded: their sum, which is what the replicas still
owe the gradient sum, becomes replica 0's residual (docs/communication.md).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from trainspec.jax.checksum import checksums, first_mismatch
from trainspec.core.compression import RESIDUAL
from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec
from trainspec.core.store import (  # noqa: F401 (CheckpointSaveError re-exported)
    BadCheckpoint, Checkpoints, CheckpointSaveError, check_compatible, due, first_line,
    save_failed)
from trainspec.jax.runtime import is_writer

FORMAT = 2  # 2: the meta holds per-array checksums


def _by_path(state):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]


def check_replicas(saved_shapes: dict, target, step: int) -> None:
    """Raise UserInputError when an array's saved shape differs from the planned one. Global
    shapes do not depend on the mesh, except the leading axis of state kept per data-parallel
    replica (semi_sync groups, compression residuals), which is the number of replicas."""
    for path, x in _by_path(target):
        was = saved_shapes.get(path)
        if was is not None and tuple(was) != tuple(x.shape):
            raise UserInputError(
                f"mesh.axes: checkpoint {step} holds {path} for {was[0]} data-parallel replicas, "
                f"this mesh has {x.shape[0]}; state kept per replica (semi_sync, compression) "
                f"resumes only on {was[0]} replicas")


def abstract_like(state):
    """Shape, dtype and sharding of each leaf: the target orbax restores (and reshards) into.
    `state` may be concrete arrays or already abstract (ShapeDtypeStructs with shardings)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def mesh_shape(state) -> dict[str, int]:
    """Axis sizes of the mesh `state` is sharded over."""
    mesh = jax.tree.leaves(state)[0].sharding.mesh
    return {name: int(size) for name, size in mesh.shape.items()}


def residual_replicas(state) -> int | None:
    """Replicas whose error-feedback residuals `state` carries (None: it carries none)."""
    leaves = jax.tree.leaves(getattr(state, RESIDUAL, None))
    return int(leaves[0].shape[0]) if leaves else None


def _with_residual_replicas(target, replicas: int):
    """`target` with residual leaves of `replicas` rows, each row whole on the data axes (the
    saved count need not divide the current data axes)."""
    def rows(t):
        sharding = NamedSharding(t.sharding.mesh, P(None, *t.sharding.spec[1:]))
        return jax.ShapeDtypeStruct((replicas, *t.shape[1:]), t.dtype, sharding=sharding)
    return target.replace(**{RESIDUAL: jax.tree.map(rows, getattr(target, RESIDUAL))})


def _fold_residual(state, target):
    """`state` with its residuals summed into row 0 of `target`'s residual layout, other rows
    zero: the sum over replicas, all error feedback needs, is kept."""
    want = getattr(target, RESIDUAL)
    folded = jax.jit(
        lambda saved: jax.tree.map(
            lambda r, t: jnp.zeros(t.shape, t.dtype).at[0].set(jnp.sum(r, axis=0)), saved, want),
        out_shardings=jax.tree.map(lambda t: t.sharding, want))(getattr(state, RESIDUAL))
    return state.replace(**{RESIDUAL: folded})


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """orbax's handler for the state, saving each replicated array from one replica in a job of
    one process.

    On CPU and TPU orbax splits a replicated array into one slice per replica by default
    (replica-parallel), so that the hosts holding it write it together. In one process the same
    process writes every slice, and each slice is one more small program to compile and run:
    the tiny model's state on 8 CPU devices took 4.2 s to save the first time (no compilation
    cache) and 0.23 s later with it, against 1.1 s and 0.11 s without (the Intel VM, 2 cores).
    Over several processes it is kept.
    The state's leaves are arrays: the registry holds orbax's array handler and nothing else,
    so anything else is refused rather than written in some other way. That handler keeps no
    per-process array metadata (`array_metadatas/`, in orbax's default registry), which restore
    does not need: a checkpoint written with it restores as before.
    """
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=jax.process_count() > 1)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class Checkpointer:
    """Checkpoints of one run directory (`checkpoint.dir` inside it), per the spec. A context
    manager: leaving it closes orbax's manager (its background threads and open files)."""

    def __init__(self, spec: Spec, run_dir: Path):
        self.spec = spec
        self.interval = spec.checkpoint.interval
        self.directory = (Path(run_dir) / spec.checkpoint.dir).absolute()
        # The trunk's policy over orbax's layout: orbax writes, renames and lists the steps
        # (its unfinished `*.orbax-checkpoint-tmp*` are never listed) and verification is the
        # per-array checksums; the trunk decides fallback, quarantine and refusal.
        self.store = Checkpoints(self.directory, writer=is_writer(), sync=self._reload_everywhere)
        self.store.check_directory()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=spec.checkpoint.keep,
            enable_async_checkpointing=spec.checkpoint.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": _state_handler(), "meta": ocp.JsonCheckpointHandler()},
        )
        self.last_saved: int | None = None  # set by a verified restore or a completed save call

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def due(self, step: int, last_step: int) -> bool:
        return due(step, last_step, self.interval)

    # -- save ---------------------------------------------------------------------------------
    def save(self, step: int, state, total_steps: int, health: dict | None = None) -> None:
        """Start writing `state` as of `step` (steps done = next batch index); returns at once
        when `checkpoint.async_save`. The previous save is finished first (orbax). `health`:
        the non-finite guard's counts, restored with the state."""
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
            "health": health or {},
            "checksums": checksums(state),
            "shapes": {path: list(x.shape) for path, x in _by_path(state)},
            "residual_replicas": residual_replicas(state),
            "spec": self.spec.to_dict(),
            "mesh": mesh_shape(state),
        }
        with self._failing_saves_end_the_run():
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)))
        self.last_saved = step

    def wait(self) -> None:
        """Block until the background save (if any) is complete and renamed into place."""
        with self._failing_saves_end_the_run():
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _failing_saves_end_the_run(self):
        """A save that fails is one line that ends the run, not a traceback or a hang."""
        try:
            yield
        except Exception as err:  # noqa: BLE001  whatever orbax or the file system raised
            raise CheckpointSaveError(save_failed(self.directory, err)) from None

    def close(self) -> None:
        """Finish the background save, if any, and release orbax's manager."""
        with self._failing_saves_end_the_run():
            self.manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving on an error: that error is the one to report (a failed save would raise
        # again from close), so closing is best effort here.
        with contextlib.suppress(Exception):
            self.manager.close()

    # -- restore ------------------------------------------------------------------------------
    def good_steps(self) -> list[int]:
        """Finalized steps, newest first (unfinished `*.orbax-checkpoint-tmp*` never appear)."""
        self.manager.reload()
        return sorted(self.manager.all_steps(), reverse=True)

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore(self, step: int, target):
        """(state, meta) of `step`, resharded onto the shardings of `target` (see abstract_like)
        and verified against its checksums; BadCheckpoint says why it is not good.

        The meta is read and checked first: a checkpoint of another model must be reported as
        such (UserInputError), not fail as an unreadable state."""
        try:
            meta = self.read_meta(step)
        except Exception as err:  # noqa: BLE001
            raise BadCheckpoint(f"its meta does not read back ({first_line(err)})") from None
        if meta.get("format") != FORMAT or meta.get("step") != step:
            raise BadCheckpoint(f"it is not a trainspec format-{FORMAT} checkpoint of step {step}")
        check_compatible(meta["spec"], self.spec, self.directory)
        saved_replicas = meta.get("residual_replicas")
        fold = saved_replicas not in (None, residual_replicas(target))
        read_as = _with_residual_replicas(target, saved_replicas) if fold else target
        check_replicas(meta.get("shapes", {}), read_as, step)  # residuals fold, the rest not
        try:
            abstract = abstract_like(read_as)
            state = ocp.args.PyTreeRestore(
                abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
            restored = self.manager.restore(step, args=ocp.args.Composite(state=state))
        except Exception as err:  # noqa: BLE001
            raise BadCheckpoint(f"its state does not read back ({first_line(err)})") from None
        differs = first_mismatch(meta["checksums"], restored.state)
        if differs is not None:
            raise BadCheckpoint(f"the checksum of {differs} differs from the one saved")
        return (_fold_residual(restored.state, target) if fold else restored.state), meta

    def restore_latest(self, target) -> tuple[Any, dict | None]:
        """The newest good checkpoint resharded like `target`, or (None, None) when there is
        none. `target` carries the current job's shardings: the abstract state its step
        planned, so that nothing is initialised only to be overwritten. The trunk's policy
        (trainspec.core.store): newer bad ones quarantined; none good, NoGoodCheckpoint."""
        found = self.store.restore_newest(lambda step: self.restore(step, target),
                                          self.good_steps())
        if found is None:
            return None, None
        self.manager.reload()
        self.last_saved = found[1]["step"]
        return found

    @property
    def quarantine(self) -> Path:
        return self.store.quarantine_dir

    def _reload_everywhere(self) -> None:
        """Every process lists the steps again once process 0 has moved some aside."""
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("trainspec checkpoints moved aside")
        self.manager.reload()

    def set_aside(self) -> list[Path]:
        """Move every checkpoint into the quarantine (starting over keeps the old ones)."""
        return self.store.set_aside(self.good_steps())

    def saved_total_steps(self) -> int | None:
        """The run length the newest good checkpoint was planned for (its LR schedule), if any."""
        for step in self.good_steps():
            try:
                meta = self.read_meta(step)
            except Exception:  # noqa: BLE001  an unreadable meta: restore_latest says why
                continue
            check_compatible(meta["spec"], self.spec, self.directory)
            return int(meta["total_steps"])
        return None
