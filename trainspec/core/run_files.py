"""Files of a run directory that every implementation writes alike. Framework-free."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from trainspec.core.errors import UserInputError
from trainspec.core.mesh import mesh_text
from trainspec.core.spec import Spec
from trainspec.core.spec_source import to_toml

SPEC_FILE = "spec.toml"  # the spec a run dir was last trained under, --set overrides applied
# A file that each implementation's checkpoint step holds and the other's never does (orbax's
# step metadata inside the state folder; rank 0's state file), by `trainspec train --framework`.
CHECKPOINT_MARKERS = {"jax": "state/_CHECKPOINT_METADATA", "torch": "rank-00000.safetensors"}
# Orbax's step metadata at the top of a step: a JAX checkpoint in orbax's own layout, with no
# trainspec manifest (trainspec.core.store), which no implementation reads.
ORBAX_ONLY_MARKER = "_CHECKPOINT_METADATA"

class AlreadyTrained(Exception):
    """The run directory is already at (or past) the step asked for: nothing was trained and
    nothing in it changed."""

    def __init__(self, run_dir: Path, at_step: int, steps: int):
        super().__init__(f"{run_dir} is already at step {at_step} (its newest good checkpoint); "
                         f"asked to train to step {steps}: nothing trained, nothing changed")


def resume_mark(meta: dict) -> dict:
    """The fields that mark the first record after resuming from a checkpoint (its `meta`)."""
    return {"resumed_from_step": meta["data_position"],
            "resumed_from_mesh": mesh_text(meta["mesh"]) if "mesh" in meta else "not recorded"}


def resume_line(mark: dict, mesh: dict[str, int]) -> str:
    """'resumed from step N (mesh A → B)', saying so when the mesh is unchanged."""
    was, now = mark["resumed_from_mesh"], mesh_text(mesh)
    return (f"resumed from step {mark['resumed_from_step']} (mesh {was} → {now}"
            f"{', unchanged' if was == now else ''})")


def _writers(checkpoint_dir: Path):
    """(step directory, the implementation that wrote it) of each checkpoint step in
    `checkpoint_dir` that one of them marks, newest first; UserInputError, in one line, at an
    orbax-only checkpoint: it is neither good nor bad for either implementation."""
    checkpoint_dir = Path(checkpoint_dir)
    steps = [p for p in checkpoint_dir.iterdir() if p.name.isdigit()] \
        if checkpoint_dir.is_dir() else []
    for step_dir in sorted(steps, key=lambda p: int(p.name), reverse=True):
        if (step_dir / ORBAX_ONLY_MARKER).exists():
            raise UserInputError(
                f"checkpoint.dir: {step_dir} is a JAX checkpoint in orbax's own layout, without "
                "the manifest this version verifies checkpoints by; resume it with the trainspec "
                "that wrote it, or give this run another --run-dir")
        for framework, marker in CHECKPOINT_MARKERS.items():
            if (step_dir / marker).exists():
                yield step_dir, framework


def refuse_foreign_checkpoints(checkpoint_dir: Path, framework: str) -> None:
    """UserInputError, in one line, naming a checkpoint in `checkpoint_dir` that another
    framework's implementation wrote (or orbax alone): it is neither good nor bad for this
    one, not its to read."""
    for step_dir, other in _writers(checkpoint_dir):
        if other != framework:
            raise UserInputError(
                f"checkpoint.dir: {step_dir} is a checkpoint of the {other} implementation; "
                f"resume it with --framework {other}, or give this run another --run-dir")


def checkpoint_framework(checkpoint_dir: Path) -> str | None:
    """The implementation that wrote the newest checkpoint in `checkpoint_dir` (by the file
    each leaves in a step's directory), or None where there is none."""
    return next((framework for _, framework in _writers(checkpoint_dir)), None)


def write_json_atomically(path: Path, payload: dict) -> None:
    _write_atomically(path, json.dumps(payload, indent=2) + "\n")


def save_spec(spec: Spec, run_dir: Path) -> None:
    _write_atomically(Path(run_dir) / SPEC_FILE,
                      "# The spec this run directory was trained under (written by trainspec "
                      "train).\n" + to_toml(spec.to_dict()))


def saved_spec(run_dir: Path) -> Path | None:
    """The spec a run directory was trained under, if it has one."""
    path = Path(run_dir) / SPEC_FILE
    return path if path.is_file() else None


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees a half-written file


def first_missing(path: Path) -> Path | None:
    """The outermost directory of `path` that does not exist yet (what creating it makes), or
    None when it exists."""
    path, top = Path(path).absolute(), None
    while not path.exists():
        top, path = path, path.parent
    return top


def discard_if_unused(created: Path, bookkeeping: tuple[str, ...]) -> None:
    """Remove `created`, a directory this command made, when a refused start left nothing in
    it but the run's bookkeeping (files or directories named in `bookkeeping`: the lock, the
    step marks) and empty directories: a refusal writes nothing. Any other file (a record, a
    checkpoint) keeps it all."""
    if not created.is_dir():
        return
    for path in created.rglob("*"):
        if not path.is_dir() and not set(path.relative_to(created).parts) & set(bookkeeping):
            return
    shutil.rmtree(created, ignore_errors=True)
