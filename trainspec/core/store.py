"""The checkpoint policy of every backend, framework-free: when a save is due, which spec fields
a resume must match, the layout of a checkpoint directory, its manifest, verification,
quarantine and the fallback to the newest good checkpoint.

A backend only moves bytes: it writes a state's files into a directory and reads them back
into a target. Everything that decides whether those bytes may be trained on is here, once.

Layout of `<run_dir>/<checkpoint.dir>/`:
- `<step>/`: a complete checkpoint. It is written as `<step>.partial/` and renamed once every
  process's files are in it and the manifest is written, so that a process killed mid-save
  leaves nothing that looks complete (only digit names are checkpoints);
- `<step>/manifest.json`: the format, the step, the backend's meta (data position, spec, mesh,
  ...) and the size and SHA-256 of every other file of the step, taken after every process
  wrote its files (the run directory is on storage every process shares: the writer renames
  the directory other processes wrote into);
- `<checkpoint.dir>-quarantine/<step>[.n]/`: bad checkpoints, moved aside and kept.

Verification reads the manifest as JSON and hashes every file before the backend reads a
byte: a flipped bit, a truncated, foreign, missing or unlisted file makes the step bad, and
nothing in a bad step is parsed. The newest good step is restored; the bad ones newer than it
are quarantined, each with one line. When none is good the run stops with one line
(NoGoodCheckpoint) and keeps them; starting over is explicit (`set_aside`, `--restart`).
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec

log = logging.getLogger("trainspec")

MANIFEST = "manifest.json"
FORMAT = "trainspec.checkpoint/1"
PARTIAL = ".partial"
# The sections that define the computation: resuming under a different one would silently
# train another model, or feed it other data. Placement (mesh, layout, collectives) and
# bookkeeping may change.
MUST_MATCH = ("seed", "model", "optimizer", "batch", "precision", "semi_sync")
# Placement fields that change what the state holds: compression with error feedback adds a
# residual per replica.
STATE_DEFINING = (("collectives", "compression"), ("collectives", "error_feedback"))
_CHUNK = 1 << 20  # bytes hashed per read

T = TypeVar("T")


class BadCheckpoint(Exception):
    """A checkpoint whose files do not verify or do not read back; the message says why."""


class CheckpointRefusal(UserInputError):
    """The checkpoints cannot be resumed. Every process decides it alike, from the same files
    and spec: the writer alone says it."""


class NoGoodCheckpoint(CheckpointRefusal):
    """Every checkpoint is bad."""


class CheckpointSaveError(UserInputError):
    """Writing a checkpoint failed (an unwritable `checkpoint.dir`, a full disk): the run ends."""


def due(step: int, last_step: int, interval: int) -> bool:
    """Whether the state after `step` is checkpointed: every `interval` steps and at the end."""
    return interval > 0 and (step % interval == 0 or step == last_step)


def _first_difference(saved: Any, current: Any, path: str) -> tuple[str, Any, Any] | None:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            diff = _first_difference(saved.get(key), current.get(key), f"{path}.{key}")
            if diff:
                return diff
        return None
    return None if saved == current else (path, saved, current)


def check_compatible(saved: dict, spec: Spec, where: Path) -> None:
    """CheckpointRefusal naming the first computation- or state-defining field of `spec` that
    differs from `saved` (the spec a checkpoint was written under)."""
    current, defaults = spec.to_dict(), Spec().to_dict()
    diffs = [_first_difference(saved.get(section), current.get(section), section)
             for section in MUST_MATCH]
    for section, key in STATE_DEFINING:  # a spec that predates the field: its default
        was = saved.get(section, {}).get(key, defaults[section][key])
        if section == "collectives" and key == "error_feedback" and \
                current[section]["compression"] == "none":
            continue  # without a compression, error feedback changes nothing the state holds
        diffs.append(_first_difference(was, current[section][key], f"{section}.{key}"))
    for diff in diffs:
        if diff:
            field, was, now = diff
            raise CheckpointRefusal(
                f"{field}: the checkpoints in {where} were written with {was!r}, the spec says "
                f"{now!r}; use a new --run-dir, or the saved value")


def save_failed(directory: Path, err: BaseException, rank: int | None = None) -> str:
    """The one line, on every backend, for a checkpoint save into `directory` that failed
    (on `rank`, where one rank's own file failed). A full disk or quota is said as the OS says
    it whatever wrapped it (orbax's RESOURCE_EXHAUSTED, safetensors' SafetensorError): the
    user frees space, whichever framework wrote."""
    full = _no_space(directory, err)
    why = os.strerror(full) if full else first_line(err)
    where = "" if rank is None else f" on rank {rank}"
    return (f"checkpoint.dir: saving to {directory} failed{where}: {why}; the newest good "
            "checkpoint there is kept")


def _no_space(directory: Path, err: BaseException) -> int | None:
    """ENOSPC or EDQUOT where `err` is a full disk or quota (by its errno, or by the OS's
    words inside a wrapper's text), ENOSPC where the file system has no block left; else
    None."""
    for code in (errno.ENOSPC, errno.EDQUOT):
        if getattr(err, "errno", None) == code or os.strerror(code) in str(err):
            return code
    try:
        return errno.ENOSPC if os.statvfs(directory).f_bavail == 0 else None
    except OSError:
        return None


def first_line(err: BaseException) -> str:
    """`err` as one short line: its type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__


def file_digest(path: Path) -> dict:
    """{"size", "sha256"} of the file at `path`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def agreement(gather: Callable[[Any], list]) -> Callable[[str | None], str | None]:
    """An `agree` for Checkpoints over `gather` (every process's object, by process): the
    first reason any process gave, the same on every process."""
    def agree(why: str | None) -> str | None:
        return next((reason for reason in gather(why) if reason is not None), None)
    return agree


def check_resumable(directory: Path, spec: Spec) -> None:
    """The look a launcher takes before it starts any process, so that a refusal is one line
    from one process: `checkpoint.dir` is a directory (or absent), the newest good checkpoint
    (newer bad ones quarantined) was written under a compatible spec; NoGoodCheckpoint when
    none is good."""
    store = Checkpoints(directory)

    def good(step: int) -> None:
        check_compatible(store.verify(step)["meta"]["spec"], spec, store.directory)

    store.restore_newest(good)


class Checkpoints:
    """The checkpoints of one directory, per the policy above. `writer`: whether this process
    moves directories and writes manifests (the others only read). `sync()`: a barrier of
    every process, after the writer moved something. `agree(why)`: every process's verdict on
    one step made one (the first reason any process gave, or None when all read it), so that
    every process restores the same step or refuses alike."""

    def __init__(self, directory: Path, *, writer: bool = True,
                 sync: Callable[[], None] = lambda: None,
                 agree: Callable[[str | None], str | None] = lambda why: why):
        self.directory = Path(directory).absolute()
        self.writer, self.sync, self.agree = writer, sync, agree

    @property
    def quarantine_dir(self) -> Path:
        return self.directory.with_name(self.directory.name + "-quarantine")

    def check_directory(self) -> None:
        """CheckpointRefusal when `checkpoint.dir` exists and is not a directory: a resume would
        otherwise find no checkpoint and start over from step 0."""
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointRefusal(f"checkpoint.dir: {self.directory} exists and is not a "
                                 "directory; move it away, or give this run another --run-dir")

    def steps(self) -> list[int]:
        """Complete checkpoints (not yet verified), newest first."""
        self.check_directory()
        if not self.directory.is_dir():
            return []
        return sorted((int(p.name) for p in self.directory.iterdir()
                       if p.name.isdigit() and p.is_dir()), reverse=True)

    # -- writing -------------------------------------------------------------------------
    def partial(self, step: int) -> Path:
        """`<step>.partial`, where every process writes its files (a killed save's is removed
        by the writer first; call `sync()` before other processes write into it)."""
        path = self.directory / f"{step}{PARTIAL}"
        if self.writer:
            self.check_directory()
            if path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
        return path

    def seal(self, step: int, meta: dict, keep: int) -> Path:
        """Writer only, once every process's files are in `<step>.partial`: the manifest (the
        files' sizes and hashes, `meta`), then the rename to `<step>`; checkpoints older than
        the newest `keep` are deleted. Returns the step's directory."""
        partial, final = self.directory / f"{step}{PARTIAL}", self.directory / str(step)
        manifest = {"format": FORMAT, "step": step, "meta": meta,
                    "files": {name: file_digest(partial / name) for name in _files(partial)}}
        with open(partial / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_directory(self.directory)
        for old in self.steps()[keep:] if keep > 0 else ():
            shutil.rmtree(self.directory / str(old))
        return final

    # -- reading -------------------------------------------------------------------------
    def manifest(self, step: int) -> dict:
        """The manifest of `step`, read as JSON and checked for form (its files not hashed);
        BadCheckpoint when it does not read."""
        try:
            manifest = json.loads((self.directory / str(step) / MANIFEST).read_text())
        except FileNotFoundError:
            raise BadCheckpoint(f"it has no {MANIFEST}") from None
        except (OSError, ValueError) as err:
            raise BadCheckpoint(f"its {MANIFEST} does not read ({first_line(err)})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
                or manifest.get("step") != step or not isinstance(manifest.get("meta"), dict) \
                or not isinstance(manifest.get("files"), dict):
            raise BadCheckpoint(f"its {MANIFEST} is not a {FORMAT} manifest of step {step}")
        return manifest

    def verify(self, step: int) -> dict:
        """The manifest of `step` once every file matches it; BadCheckpoint otherwise.
        Nothing but the manifest's JSON is parsed."""
        manifest, where = self.manifest(step), self.directory / str(step)
        listed, present = manifest["files"], _files(where)
        for name in sorted(set(present) - set(listed)):
            raise BadCheckpoint(f"it holds {name}, which its manifest does not list")
        for name, want in sorted(listed.items()):
            if name not in present:
                raise BadCheckpoint(f"{name} is missing")
            have = file_digest(where / name)
            if have["size"] != want.get("size"):
                raise BadCheckpoint(f"{name} has {have['size']} bytes, "
                                    f"{want.get('size')} were written")
            if have["sha256"] != want.get("sha256"):
                raise BadCheckpoint(f"the SHA-256 of {name} differs from the one written")
        return manifest

    def verified(self, step: int) -> dict:
        """`verify(step)` on the writer, whose verdict every process takes (the others read
        the manifest only: the files are the same bytes on the shared storage); nothing of a
        step is read by any process before the writer found it good."""
        try:
            manifest, why = (self.verify(step) if self.writer else self.manifest(step)), None
        except BadCheckpoint as err:
            manifest, why = None, str(err)
        why = self.agree(why)
        if why is not None:
            raise BadCheckpoint(why)
        return manifest

    def restore_newest(self, restore: Callable[[int], T],
                       steps: Iterable[int] | None = None) -> T | None:
        """`restore(step)` of the newest step it succeeds on (BadCheckpoint: it did not), the
        same step on every process; the bad ones newer than it are quarantined, each named in
        one line. None when there is no checkpoint; NoGoodCheckpoint when none is good (they
        all stay in place)."""
        bad: list[tuple[int, str]] = []
        for step in self.steps() if steps is None else steps:
            try:
                result, why = restore(step), None
            except BadCheckpoint as err:
                result, why = None, str(err)
            why = self.agree(why)
            if why is not None:
                bad.append((step, why))
                continue
            for bad_step, reason in bad:
                moved = self.quarantine(bad_step)
                if self.writer:
                    log.warning("checkpoint %d is bad (%s): moved to %s; resuming from "
                                "checkpoint %d", bad_step, reason, moved, step)
            if bad:
                self.sync()
            return result
        if bad:
            newest, why = bad[0]
            raise NoGoodCheckpoint(
                f"checkpoint.dir: all {len(bad)} checkpoints in {self.directory} are bad "
                f"(newest, {newest}: {why}); they are kept; pass --restart to train from step 0")
        return None

    def saved_total_steps(self, spec: Spec, steps: Iterable[int] | None = None) -> int | None:
        """The run length the newest checkpoint whose manifest reads was planned for (its
        learning-rate schedule); CheckpointRefusal when `spec` cannot resume it, before a run
        writes anything. Its files are verified later, by the restore."""
        for step in self.steps() if steps is None else steps:
            try:
                meta = self.manifest(step)["meta"]
                total_steps = int(meta["total_steps"])
            except (BadCheckpoint, KeyError, TypeError, ValueError):  # the restore says why
                continue
            check_compatible(meta.get("spec", {}), spec, self.directory)
            return total_steps
        return None

    # -- moving aside ----------------------------------------------------------------------
    def quarantine(self, step: int) -> Path:
        """Move `step` into the quarantine (the writer; the others only learn where)."""
        target, suffix = self.quarantine_dir / str(step), 1
        while target.exists():
            target, suffix = self.quarantine_dir / f"{step}.{suffix}", suffix + 1
        if self.writer:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.directory / str(step)), target)
        return target

    def set_aside(self, steps: Iterable[int] | None = None) -> list[Path]:
        """Move every checkpoint into the quarantine (starting over keeps the old ones)."""
        moved = [self.quarantine(step) for step in (self.steps() if steps is None else steps)]
        self.sync()
        return moved
