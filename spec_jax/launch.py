"""Start N local processes of one command as a distributed job, and keep them together.

Each child gets TRAINSPEC_COORDINATOR / TRAINSPEC_NUM_PROCESSES / TRAINSPEC_PROCESS_ID, which
both implementations join from (spec_jax/distributed.py for JAX, spec_jax/adapters/torch.py).
This module imports no framework. Output lines are prefixed with the rank. If one child fails, the others are
stopped (SIGTERM, then SIGKILL after a grace period), so a job never outlives a dead rank: with
a peer gone the survivors would otherwise block in their next collective until a timeout.
SIGINT/SIGTERM to the launcher are forwarded. Children die with the launcher (PR_SET_PDEATHSIG)
so not even a SIGKILL of the launcher leaves orphans.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

# The job description every rank reads (framework-neutral: no framework is imported here).
COORDINATOR = "TRAINSPEC_COORDINATOR"
NUM_PROCESSES = "TRAINSPEC_NUM_PROCESSES"
PROCESS_ID = "TRAINSPEC_PROCESS_ID"

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the launcher's own cleanup still applies
        pass


def _pump(rank: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[rank {rank}] {line}")
        out.flush()
    stream.close()


class Launch:
    def __init__(self, command: Sequence[str], nprocs: int, grace_s: float = 10.0,
                 port: int | None = None):
        self.command, self.nprocs, self.grace_s = list(command), nprocs, grace_s
        self.port = port or free_port()
        self.children: list[subprocess.Popen] = []
        self._pumps: list[threading.Thread] = []

    def _env(self, rank: int) -> dict[str, str]:
        return {
            **os.environ,
            COORDINATOR: f"127.0.0.1:{self.port}",
            NUM_PROCESSES: str(self.nprocs),
            PROCESS_ID: str(rank),
            "PYTHONUNBUFFERED": "1",
        }

    def start(self) -> None:
        for rank in range(self.nprocs):
            child = subprocess.Popen(
                self.command, env=self._env(rank), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent,
                start_new_session=True,  # its own process group: we signal the whole group
            )
            self.children.append(child)
            print(f"[launch] rank {rank} pid {child.pid}", flush=True)
            pump = threading.Thread(target=_pump, args=(rank, child.stdout, sys.stdout), daemon=True)
            pump.start()
            self._pumps.append(pump)

    def _signal_all(self, sig: int) -> None:
        for child in self.children:
            if child.poll() is None:
                try:
                    os.killpg(child.pid, sig)
                except ProcessLookupError:
                    pass

    def stop_all(self) -> None:
        """SIGTERM every live child, SIGKILL what is left after the grace period."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(c.poll() is None for c in self.children):
            time.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        for child in self.children:
            child.wait()

    def wait(self) -> int:
        """Exit status of the job: 0 if all ranks succeed, else the first failure's."""
        try:
            while True:
                codes = [c.poll() for c in self.children]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    rank, code = failed[0]
                    print(f"[launch] rank {rank} exited with {code}; stopping the others",
                          file=sys.stderr, flush=True)
                    self.stop_all()
                    return code if code > 0 else 128 - code  # -9 (killed) -> 137, like a shell
                if all(c == 0 for c in codes):
                    return 0
                time.sleep(0.05)
        finally:
            for pump in self._pumps:
                pump.join(timeout=1)


def run(command: Sequence[str], nprocs: int, grace_s: float = 10.0) -> int:
    launch = Launch(command, nprocs, grace_s)

    def forward(signum, _frame):
        print(f"[launch] got signal {signum}; stopping all ranks", file=sys.stderr, flush=True)
        launch.stop_all()
        sys.exit(128 + signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launch.start()
        return launch.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
