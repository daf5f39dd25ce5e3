"""Start N local processes of one command as a distributed job, and keep them together.

Each child gets TRAINSPEC_COORDINATOR / TRAINSPEC_NUM_PROCESSES / TRAINSPEC_PROCESS_ID, which
both implementations join from (trainspec/jax/runtime.py for JAX, trainspec/torch/runtime.py).
This module imports no framework. Output lines are prefixed with the rank; gloo's per-rank
connection notices are left out unless `verbose`. If one child fails,
the launcher names the first to fail (by when it exited, not by rank: once a rank dies the
others abort in their next collective) and its status or signal, and stops the others
(SIGTERM, then SIGKILL after the grace period), so a job never outlives a dead rank. Where
the first to exit did so because others did not arrive (a stopped or stalled rank: its line
names them, trainspec.core.arrivals), the launcher blames those, and kills them at once. A
refusal (`trainspec: error: ...`) that several ranks say alike is relayed once, and where the
first rank to fail said one, the launcher adds no line of its own: a bad input is one line.

SIGINT/SIGTERM to the launcher are forwarded to every rank as SIGTERM, the preemption notice:
each rank finishes its step, checkpoints (all at the same step) and exits 143 (trainspec.core.
run); the launcher waits for that within the grace period (`--grace`), then exits
128 + the signal it got. Children die with the launcher (PR_SET_PDEATHSIG) so not even a
SIGKILL of the launcher leaves orphans.
"""
from __future__ import annotations

import ctypes
import os
import random
import re
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from trainspec.core import arrivals, topology

# The job description every rank reads (framework-neutral: no framework is imported here).
COORDINATOR = "TRAINSPEC_COORDINATOR"
NUM_PROCESSES = "TRAINSPEC_NUM_PROCESSES"
PROCESS_ID = "TRAINSPEC_PROCESS_ID"
# The interface the job's coordinator listens on (JAX's coordination service, torch rank 0's
# TCPStore) when not the one its address names (docs/scale-out.md).
COORDINATOR_BIND = "TRAINSPEC_COORDINATOR_BIND"

_PR_SET_PDEATHSIG = 1
DEFAULT_GRACE_S = 30.0  # SIGTERM to SIGKILL: time for every rank to write its checkpoint
# Printed by gloo (jax's and torch's CPU collectives) for every rank at every connection: noise
# unless one is debugging the rendezvous. Its "is NOT connected to" failure line stays. It is
# written piece by piece (text, number, text...), by several threads of a rank at once, and a
# progress bar's carriage return (a line end to the reader) can land between any two pieces: so
# each piece is cut out where it is, with the number beside it, and a line that held pieces and
# is left with nothing but digits is dropped.
GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank \d*|\d* ?is connected to \d*| ?peer ranks\. ?|"
                            r"Expected number of connected peer ranks is : ?\d*")


# How long the launcher waits, once the ranks have exited, for their last output lines: a
# pump thread on a loaded machine can take more than a second to get the CPU.
DRAIN_S = 15.0
# How long the launcher waits for the last line of the rank that failed first, which may name
# the ranks it waited for.
BLAME_WAIT_S = 2.0


# Where the kernel draws the ports it picks by itself (bind to port 0, an outgoing connection's
# local end). A port from there, released by the launcher before rank 0 binds it, can be taken
# in between by any connection on the machine: under the test suite's load, gloo's connections
# among other jobs' ranks took one and rank 0 failed with EADDRINUSE. Below the range, only a
# process that names the port can take it.
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
PORTS_BELOW_EPHEMERAL = 10_000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: drawn at random from the 10,000 below the kernel's
    ephemeral range (Linux), else one the kernel picks."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 1024
    below = range(max(1024, low - PORTS_BELOW_EPHEMERAL), low)
    # SystemRandom: a caller's random.seed must not make concurrent launches draw alike.
    for port in random.SystemRandom().sample(below, min(len(below), 64)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def coordinator_bind(coordinator: str) -> str:
    """The `host:port` the job's coordinator at `coordinator` listens on: its own address, on
    the host TRAINSPEC_COORDINATOR_BIND names when set (`0.0.0.0`: every interface). So a
    local job's (127.0.0.1, as `trainspec launch` gives it) is reachable from this host alone,
    and a multi-host job's listens on the interface its address names, not on every one."""
    host, port = split_host_port(coordinator)
    host = os.environ.get(COORDINATOR_BIND) or host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the launcher's own cleanup still applies
        pass


def _child_setup(cpus: set[int] | None):
    """Between fork and exec: die with the launcher, and pin to `cpus` (inherited by every
    thread the rank starts, its input threads included)."""
    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


# The launcher's own lines and every rank's pump write to one terminal from several threads
# (and the SIGTERM handler from the main thread, hence reentrant): each line goes out whole,
# in one write under this lock. print() writes a message and its newline separately, so a
# rank's line could land between them.
_OUTPUT = threading.RLock()


def _say(line: str, out=None) -> None:
    out = sys.stdout if out is None else out  # looked up per call: tests capture sys.stdout
    with _OUTPUT:
        out.write(line if line.endswith("\n") else line + "\n")
        out.flush()


# How a rank says why it stops (trainspec.cli.outcomes): a bad input every rank finds alike (a
# spec field, a run dir) comes once from each; the launcher relays it once.
REFUSAL = "trainspec: error: "


class _Said:
    """What the ranks have said so far, across their output pumps."""

    def __init__(self):
        self.blamed: dict[int, list[int]] = {}  # rank -> the ranks its line says did not arrive
        self.refusals: set[str] = set()  # each `trainspec: error:` line relayed
        self.refused: set[int] = set()  # ranks that said one


def _pump(rank: int, stream, out, verbose: bool, said: _Said) -> None:
    for line in iter(stream.readline, ""):
        late = []
        if found := arrivals.BLAME.search(line):  # this rank names the ranks it waited for
            late = [int(r) for r in found.group(1).split(",")]
            said.blamed.setdefault(rank, late)
        if not verbose and "NOT connected" not in line:
            line, pieces = GLOO_CONNECTED.subn("", line)
            if not line.strip(string.digits + string.whitespace if pieces else string.whitespace):
                continue
        with _OUTPUT:
            if line.startswith(REFUSAL):
                said.refused.add(rank)
                if line in said.refusals:  # another rank said it already
                    continue
                if late and set(late) <= said.refused:  # they left saying why: this rank
                    continue  # only lost them (a full disk on one rank fails its peers' next step)
                said.refusals.add(line)
            _say(f"[rank {rank}] {line}", out)
    stream.close()


class Launch:
    def __init__(self, command: Sequence[str], nprocs: int, grace_s: float = DEFAULT_GRACE_S,
                 port: int | None = None, bind: str | None = None, verbose: bool = False):
        self.command, self.nprocs, self.grace_s = list(command), nprocs, grace_s
        self.verbose = verbose
        nodes = topology.numa_nodes()
        self.bind = bind or topology.default_policy(nodes)  # numa where there are several nodes
        allowed = os.sched_getaffinity(0)
        self.cpus = [topology.bind_cpus(self.bind, r, nprocs, nodes, allowed) for r in range(nprocs)]
        self.port = port or free_port()
        self.children: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []  # output pumps and exit watchers
        self._pumps: list[threading.Thread] = []
        self.exits: list[tuple[int, int]] = []  # (rank, status) in the order the ranks exited
        self.said = _Said()
        self._exited = threading.Condition()

    def _env(self, rank: int) -> dict[str, str]:
        return {
            **os.environ,
            COORDINATOR: f"127.0.0.1:{self.port}",
            NUM_PROCESSES: str(self.nprocs),
            PROCESS_ID: str(rank),
            "PYTHONUNBUFFERED": "1",
            "TRAINSPEC_BIND": self.bind,  # shown by `trainspec doctor`
            **_loopback_gloo(),
        }

    def start(self) -> None:
        for rank in range(self.nprocs):
            child = subprocess.Popen(
                self.command, env=self._env(rank), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, preexec_fn=_child_setup(self.cpus[rank]),
                start_new_session=True,  # its own process group: we signal the whole group
            )
            self.children.append(child)
            pinned = f", --bind {self.bind}: CPUs {sorted(self.cpus[rank])}" if self.cpus[rank] else ""
            _say(f"[launch] rank {rank} pid {child.pid}{pinned}")
            pump = (rank, child.stdout, sys.stdout, self.verbose, self.said)
            for target, args in ((_pump, pump),
                                 (self._watch, (rank, child))):
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                self._threads.append(thread)
            self._pumps.append(self._threads[-2])

    def _watch(self, rank: int, child: subprocess.Popen) -> None:
        status = child.wait()
        with self._exited:
            self.exits.append((rank, status))
            self._exited.notify_all()

    def _signal(self, rank: int, sig: int) -> None:
        child = self.children[rank]
        if child.poll() is None:
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                pass

    def _signal_all(self, sig: int) -> None:
        for rank in range(len(self.children)):
            self._signal(rank, sig)

    def stop_all(self) -> None:
        """SIGTERM every live child, SIGKILL what is left after the grace period."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(c.poll() is None for c in self.children):
            time.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        for child in self.children:
            child.wait()

    def drain(self, timeout_s: float = DRAIN_S) -> None:
        """Let the output pumps relay what exited ranks printed last (their "saved" lines).
        Bounded: a grandchild that kept a rank's stdout open must not hold the launcher."""
        deadline = time.monotonic() + timeout_s
        for pump in self._pumps:
            pump.join(timeout=max(0.0, deadline - time.monotonic()))

    def wait(self) -> int:
        """Exit status of the job: 0 if all ranks succeed, else the first failure's."""
        try:
            with self._exited:
                while not (failed := [e for e in self.exits if e[1] != 0]) and \
                        len(self.exits) < len(self.children):
                    self._exited.wait(timeout=0.5)  # a timeout, so that signals get through
            if not failed:
                return 0
            rank, status = failed[0]
            self._pumps[rank].join(timeout=BLAME_WAIT_S)  # its last line: whom it blames
            if blamed := self.said.blamed.get(rank):
                _say(f"[launch] rank(s) {', '.join(map(str, blamed))} did not arrive (rank "
                     f"{rank} {describe_status(status)} saying so); stopping the others",
                     sys.stderr)
                for late in blamed:  # stalled or stopped: nothing to wait for
                    if late < len(self.children):
                        self._signal(late, signal.SIGKILL)
            elif rank not in self.said.refused:  # else its line said why: one line in all
                _say(f"[launch] rank {rank} {describe_status(status)} first; stopping the "
                     "others", sys.stderr)
            self.stop_all()
            return status if status > 0 else 128 - status  # -9 (killed) -> 137, like a shell
        finally:
            self.drain()


def _loopback_gloo() -> dict[str, str]:
    """torch's gloo listens for its peers on the address this host's name resolves to (not
    always loopback) unless GLOO_SOCKET_IFNAME names an interface: a job on this host alone
    gets the loopback one, where the user named none."""
    if "GLOO_SOCKET_IFNAME" in os.environ or "lo" not in dict(socket.if_nameindex()).values():
        return {}
    return {"GLOO_SOCKET_IFNAME": "lo"}


def describe_status(status: int) -> str:
    """A child's exit as a person says it: "exited with status 3", "was killed by SIGKILL"."""
    if status >= 0:
        return f"exited with status {status}"
    try:
        return f"was killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"was killed by signal {-status}"


def run(command: Sequence[str], nprocs: int, grace_s: float = DEFAULT_GRACE_S,
        bind: str | None = None, verbose: bool = False) -> int:
    launch = Launch(command, nprocs, grace_s, bind=bind, verbose=verbose)

    def forward(signum, _frame):
        _say(f"[launch] {signal.Signals(signum).name}: every rank checkpoints and stops "
             f"(grace {grace_s:g} s)", sys.stderr)
        launch.stop_all()
        launch.drain()
        # Every child is reaped once stop_all returns; its exit watcher may not have recorded
        # it yet (launch.exits), so the statuses come from the children themselves.
        statuses = ", ".join(f"rank {r} {describe_status(c.returncode)}"
                             for r, c in enumerate(launch.children))
        _say(f"[launch] {statuses}", sys.stderr)
        sys.exit(128 + signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launch.start()
        return launch.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
