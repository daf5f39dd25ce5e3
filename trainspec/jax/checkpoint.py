"""Checkpoints of the JAX implementation, under the trunk's policy (trainspec.core.store): the
layout (`<step>.partial/` renamed to `<step>/` once complete), the manifest of every file's
size and SHA-256, verification before anything is read, quarantine, fallback to the newest good
checkpoint, and the spec fields a resume must match, are the trunk's. This module moves the
bytes, with orbax: the train state (parameters, optimizer state, its step counter) as sharded
arrays in `<step>.partial/state/`, written by every process. The meta (in the manifest) holds
the step, the data position, the RNG, the run's length, the non-finite guard's counts, the spec,
the mesh the state was sharded over (a resume says from which mesh it came), every array's
global shape and a checksum of its content.

Saving, under `checkpoint.async_save`: the state is copied to host memory and the step returns
while orbax writes it in the background; a thread of this process then waits for orbax's
finalize (every process's files in, through orbax's own barriers) and the writer seals the
checkpoint (manifest, rename). `wait()` blocks until then; the next save, a restore and the end
of the run wait first. A process killed at any point leaves at most a `<step>.partial/`, which
is never a checkpoint.

Restoring: the writer verifies every file against the manifest and every process takes its
verdict (one `agree` over the job's processes), so that all of them restore the same step or
none. The state is then read onto the *current* job's shardings (the target is the abstract
state its step planned): a run saved on (data=4, fsdp=2) restores onto 4 devices, or onto
(data=2, fsdp=4), directly. The data position is the step: batches are a pure function of
(seed, step) (data.py), so resuming at step S on any mesh continues with exactly batch S.
A compressed run's error-feedback residuals (one per data-parallel replica) are read back as
saved and, onto another replica count, folded: their sum, which is what the replicas still
owe the gradient sum, becomes replica 0's residual (docs/communication.md).

Every restored array is then checked against the checksum taken of it on device when it was
saved (trainspec.jax.checksum). The manifest certifies the files as orbax wrote them; the
checksums certify the arrays as they were trained and as they arrive on the devices, so they
also catch what the files' digests cannot: bytes orbax wrote or read back wrong (serialization,
its merge of the processes' databases, resharding onto another mesh) and a file changed between
verification and the read. They cost one small program per save and per restore.

Checkpoints of orbax's own layout (no manifest; written before the trunk's format) are refused
by name (trainspec.core.run_files): they are neither good nor bad under this format.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from trainspec.core.compression import RESIDUAL
from trainspec.core.errors import UserInputError
from trainspec.core.run_files import refuse_foreign_checkpoints
from trainspec.core.spec import Spec
from trainspec.core.store import (  # noqa: F401 (CheckpointSaveError re-exported)
    BadCheckpoint, Checkpoints, CheckpointSaveError, agreement, check_compatible, due,
    first_line, save_failed)
from trainspec.jax.checksum import checksums, first_mismatch
from trainspec.jax.pipeline_params import staged_like, whole_abstract, whole_arrays
from trainspec.jax.runtime import JaxRuntime, is_writer

FORMAT = "trainspec.jax/3"  # 3: orbax's files under the trunk's manifest
STATE = "state"  # the folder of a step that orbax writes the state into


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
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


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
    process writes every slice, and each slice is one more small program to compile and run, for
    no parallelism; over several processes it is kept.
    The state's leaves are arrays: the registry holds orbax's array handler and nothing else,
    so anything else is refused rather than written in some other way. That handler keeps no
    per-process array metadata (`array_metadatas/`, in orbax's default registry), which restore
    does not need.
    """
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=jax.process_count() > 1)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class Checkpointer:
    """Checkpoints of one run directory (`checkpoint.dir` inside it), per the spec; process 0
    seals and moves them. A context manager: leaving it finishes the save in flight and closes
    orbax's checkpointer (its background threads and open files)."""

    def __init__(self, spec: Spec, run_dir: Path):
        self.spec = spec
        self.interval, self.keep = spec.checkpoint.interval, spec.checkpoint.keep
        self.store = Checkpoints(Path(run_dir) / spec.checkpoint.dir, writer=is_writer(),
                                 sync=_barrier, agree=agreement(JaxRuntime().gather_objects))
        self.store.check_directory()
        self.directory = self.store.directory
        self._orbax = ocp.AsyncCheckpointer(_state_handler())
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainspec-seal")
        self._sealing: Future | None = None  # the save in flight: orbax's finalize, the seal
        self.last_saved: int | None = None  # set by a verified restore or a completed save call

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def due(self, step: int, last_step: int) -> bool:
        return due(step, last_step, self.interval)

    # -- what is on disk ----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Complete checkpoints (not yet verified), newest first; another implementation's,
        and orbax-only ones, are refused by name."""
        refuse_foreign_checkpoints(self.directory, "jax")
        return self.store.steps()

    @property
    def quarantine(self) -> Path:
        return self.store.quarantine_dir

    def set_aside(self) -> list[Path]:
        """Move every checkpoint, whoever wrote it, into the quarantine (starting over keeps
        the old ones)."""
        self.wait()
        return self.store.set_aside()

    def saved_total_steps(self) -> int | None:
        """The run length the newest readable checkpoint was planned for (its LR schedule);
        a spec that cannot resume it is refused here, before anything is written."""
        return self.store.saved_total_steps(self.spec, self.steps())

    # -- save ---------------------------------------------------------------------------------
    def save(self, step: int, state, total_steps: int, health: dict | None = None) -> None:
        """Start writing `state` as of `step` (steps done = next batch index); returns once
        orbax holds a host copy when `checkpoint.async_save`, else once it is sealed. The
        previous save is complete and sealed first. `health`: the non-finite guard's counts,
        restored with the state."""
        if not self.enabled or step == self.last_saved:
            return
        state = whole_arrays(state)  # one leaf per block, whatever the stage count
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
        self.wait()
        with self._failing_saves_end_the_run():
            # The writer empties `<step>.partial` before orbax's first barrier, which every
            # process passes before it writes there.
            partial = self.store.partial(step)
            self._orbax.save(partial / STATE, args=ocp.args.PyTreeSave(state))
        self._sealing = self._sealer.submit(self._seal, step, meta)
        if not self.spec.checkpoint.async_save:
            self.wait()
        self.last_saved = step

    def _seal(self, step: int, meta: dict) -> None:
        """In the background: once orbax has finalized `step` (every process's files in, the
        processes past orbax's commit barrier), the writer seals it."""
        self._orbax.wait_until_finished()
        if self.store.writer:
            self.store.seal(step, meta, self.keep)

    def wait(self) -> None:
        """Block until the last save is complete (written, finalized and sealed); a failed
        save is raised here, as one line."""
        sealing, self._sealing = self._sealing, None
        if sealing is not None:
            with self._failing_saves_end_the_run():
                sealing.result()

    @contextlib.contextmanager
    def _failing_saves_end_the_run(self):
        """A save that fails is one line that ends the run, not a traceback or a hang."""
        try:
            yield
        except Exception as err:  # noqa: BLE001  whatever orbax or the file system raised
            raise CheckpointSaveError(save_failed(self.directory, err)) from None

    def close(self) -> None:
        """Finish the save in flight, if any, and release orbax's checkpointer."""
        try:
            self.wait()
        finally:
            self._sealer.shutdown()
            with self._failing_saves_end_the_run():
                self._orbax.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving on an error: that error is the one to report (a failed save would raise
        # again from close), so closing is best effort here.
        with contextlib.suppress(Exception):
            self.close()

    # -- restore ------------------------------------------------------------------------------
    def restore(self, step: int, target):
        """(state, meta) of `step`, resharded onto the shardings of `target` (see abstract_like)
        and checked against its checksums; BadCheckpoint says why it is not good. Nothing of
        the step is read before the writer verified its files; a checkpoint of another model
        is a UserInputError naming the field, not a bad state."""
        meta = self.store.verified(step)["meta"]
        if meta.get("format") != FORMAT or not isinstance(meta.get("spec"), dict) \
                or not isinstance(meta.get("checksums"), dict):
            raise BadCheckpoint(f"its meta is not that of a {FORMAT} checkpoint")
        staged, target = target, whole_abstract(target)  # saved one leaf per block
        check_compatible(meta["spec"], self.spec, self.directory)
        saved_replicas = meta.get("residual_replicas")
        fold = saved_replicas not in (None, residual_replicas(target))
        read_as = _with_residual_replicas(target, saved_replicas) if fold else target
        check_replicas(meta.get("shapes", {}), read_as, step)  # residuals fold, the rest not
        abstract = abstract_like(read_as)
        try:
            state, why = self._orbax.restore(
                self.directory / str(step) / STATE, args=ocp.args.PyTreeRestore(
                    abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
            ), None
        except Exception as err:  # noqa: BLE001  whatever orbax raised on files that verified
            state, why = None, f"its state does not read back ({first_line(err)})"
        why = self.store.agree(why)  # every process holds the state, or none: the checksums
        if why is not None:  # below are computed over every process's devices
            raise BadCheckpoint(why)
        differs = first_mismatch(meta["checksums"], state)
        if differs is not None:
            raise BadCheckpoint(f"the checksum of {differs} differs from the one saved")
        state = _fold_residual(state, target) if fold else state
        return staged_like(state, staged), meta

    def restore_latest(self, target) -> tuple[Any, dict | None]:
        """The newest good checkpoint resharded like `target`, or (None, None) when there is
        none. `target` carries the current job's shardings: the abstract state its step
        planned, so that nothing is initialised only to be overwritten. The trunk's policy
        (trainspec.core.store): newer bad ones quarantined; none good, NoGoodCheckpoint."""
        self.wait()
        found = self.store.restore_newest(lambda step: self.restore(step, target), self.steps())
        if found is None:
            return None, None
        self.last_saved = found[1]["step"]
        return found


def _barrier() -> None:
    """Every process waits here until all have come (after the writer moved checkpoints)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("trainspec checkpoints moved")
