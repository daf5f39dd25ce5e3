"""Which processes of a job did not arrive, when a collective across processes gives up.

Every process of a multi-process job marks each step it enters (hands its batch to the
framework's step, whose collectives then wait for the others) in RUN_DIR/ranks/<rank>: one
small `pwrite` per step on the host, no device sync, no message. When a collective fails
(gloo's timeout, or a peer's connection gone), the process reads the marks and names the
ranks that are behind it, or whose process is gone or stopped (this host's only: /proc), in
its one line; `trainspec launch` reads that line and blames those ranks, not the first rank
to exit. Framework-free: JAX's and torch's CPU collectives are both gloo, and fail alike.
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path

MARKS_DIR = "ranks"
_MARK_BYTES = 96  # fixed width: each mark overwrites the last whole
# gloo's words for a peer that did not arrive or went away (XLA:CPU's and torch's alike)
_PEER_LOST = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
              "Broken pipe", "Connection refused", "Socket closed",
              "Application timeout caused pair closure",  # a pair another wait already timed out
              "Gloo context initialization failed")  # a peer that never reached the first
# The launcher finds the ranks a process blames in its line by this phrase.
BLAME = re.compile(r"for rank\(s\) ([\d, ]+), which did not arrive")


class StepMarks:
    """This process's mark: the step it last entered, its pid and host; nothing for a job of
    one process (`world` 1). Left open to the process's end."""

    def __init__(self, run_dir: Path, rank: int, world: int):
        self._fd = None
        if world > 1:
            directory = Path(run_dir) / MARKS_DIR
            directory.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(directory / str(rank), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC,
                               0o644)
            self._tail = f" {os.getpid()} {socket.gethostname()}"
            self.entered(0)

    def entered(self, step: int) -> None:
        if self._fd is not None:
            line = f"{step}{self._tail}".ljust(_MARK_BYTES - 1).encode() + b"\n"
            os.pwrite(self._fd, line, 0)


def peer_lost(text: str) -> bool:
    """Whether an error's text is gloo giving up on a peer (gone or not arriving)."""
    return any(phrase in text for phrase in _PEER_LOST)


def _state(pid: int, host: str) -> str | None:
    """"gone" or "stopped" for a process of this host that is; None where it runs or is
    on another host (nothing known)."""
    if host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state)


def _marks(run_dir: Path, world: int) -> dict[int, tuple[int, int, str]]:
    marks = {}
    for rank in range(world):
        try:
            step, pid, host = (Path(run_dir) / MARKS_DIR / str(rank)).read_text().split()
            marks[rank] = int(step), int(pid), host
        except (OSError, ValueError):
            continue
    return marks


def missing(run_dir: Path, world: int, me: int) -> dict[int, tuple[int, str]]:
    """The ranks of a `world`-rank job that did not arrive, as `rank -> (the step whose
    collectives it did not join, why)`: the ranks whose process is gone or stopped (this
    host's processes), where any is; else those behind the furthest rank (the step after their
    own). A stopped rank comes first because the others wait on it at different steps: gloo's
    ring lets a rank finish a collective the stopped one left half done and enter the next
    step, which puts every rank still waiting behind it."""
    marks = _marks(run_dir, world)
    furthest = max((step for step, _, _ in marks.values()), default=0)
    states = {rank: _state(pid, host) for rank, (_, pid, host) in marks.items() if rank != me}
    dead = {rank for rank, state in states.items() if state is not None}
    found = {}
    for rank, (step, pid, _) in sorted(marks.items()):
        if rank != me and (rank in dead if dead else step < furthest):
            state = states[rank]
            found[rank] = step + (step < furthest), f"rank {rank} last entered step {step}" + (
                f", its process {pid} {state}" if state else "")
    return found


def collective_of(text: str) -> str:
    """The collective an error names (XLA:CPU's "Gloo all-reduce failed"), else "a
    collective"."""
    named = re.search(r"Gloo ([\w-]+) failed", text)
    return named.group(1) if named else "collective"


def peer_lost_line(run_dir: Path, world: int, me: int, collective: str,
                   timeout_s: float) -> str:
    """The one line of process `me` whose `collective` gave up on a peer: which ranks did not
    arrive, at which step (the first one a missing rank did not finish)."""
    behind = missing(run_dir, world, me)
    mine = _marks(run_dir, world).get(me, (0, 0, ""))[0]
    if not behind:
        return (f"collectives.timeout_s: rank {me}'s {collective} (it had entered step {mine}) "
                f"lost a peer within {timeout_s:g} s, and no rank is known to be behind; the "
                "same command resumes from the newest good checkpoint")
    step = min(step for step, _ in behind.values())
    return (f"collectives.timeout_s: step {step}'s {collective} waited up to {timeout_s:g} s "
            f"for rank(s) {', '.join(map(str, behind))}, which did not arrive "
            f"({'; '.join(why for _, why in behind.values())}; rank {me} had entered "
            f"step {mine}); the same command resumes from the newest good checkpoint")
