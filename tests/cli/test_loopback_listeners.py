"""A local job listens on loopback only: during a 2-process JAX run and a 2-rank torch run, no
socket of the job's processes listens anywhere but loopback: not JAX's coordinator, not torch
rank 0's TCPStore, not gloo's (every rank's listener for its peers; more ranks add listeners of
the same code)."""
import os
import subprocess
import time
from pathlib import Path

import pytest

from tiny import TINY
from xla_env import without_device_count

pytestmark = pytest.mark.slow  # two jobs started and watched: about 100 s on 2 loaded cores

LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp*
WILDCARD = {"00000000", "00000000000000000000000000000000"}
# 127.0.0.1, ::1 and ::ffff:127.0.0.1 (an IPv6 socket bound to it) as /proc has them
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def _descendants(pid):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def _socket_inodes(pids):
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:  # exited meanwhile
            continue
    return inodes


def _listeners(pids):
    """(hex address, port) of every listening TCP socket the processes `pids` hold."""
    inodes, found = _socket_inodes(pids), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                address, port = fields[1].split(":")
                found.add((address, int(port, 16)))
    return found


def _listeners_during(argv, cwd):
    """Every listener the job's processes held, polled while it runs (in `cwd`); and its
    result."""
    env = {**without_device_count(), "TRAINSPEC_FAULTS": '{"delay_s": 2.0, "delay_steps": [2]}'}
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, cwd=cwd)
    seen = set()
    while job.poll() is None:
        seen |= _listeners(_descendants(job.pid))
        time.sleep(0.1)
    return seen, job.returncode, job.stdout.read()


@pytest.mark.parametrize("framework, nprocs", [("jax", 2), ("torch", 2)])
def test_a_local_job_listens_on_loopback_only(tmp_path, framework, nprocs):
    sets = [a for s in TINY for a in ("--set", s)]
    train = ["trainspec", "train", "--framework", framework, "--quiet", "--steps", "3",
             "--run-dir", str(tmp_path), *sets]
    if framework == "jax":
        argv = ["trainspec", "launch", "--nprocs", str(nprocs), "--", *train,
                "--host-devices", "2", "--set", "mesh.axes.data.size=4"]
    else:
        argv = [*train, "--nprocs", str(nprocs)]
    seen, status, output = _listeners_during(argv, tmp_path)
    assert status == 0, output
    assert seen, "the job's listeners were seen"
    wildcard = sorted(port for address, port in seen if address in WILDCARD)
    assert not wildcard, f"listening on every interface: ports {wildcard} ({seen})"
    elsewhere = sorted((address, port) for address, port in seen if address not in LOOPBACK)
    assert not elsewhere, f"listening off loopback: {elsewhere}"


def test_the_coordinator_listens_on_its_own_address_unless_told(monkeypatch):
    from trainspec.core.launch import COORDINATOR_BIND, coordinator_bind

    monkeypatch.delenv(COORDINATOR_BIND, raising=False)
    assert coordinator_bind("127.0.0.1:1234") == "127.0.0.1:1234"
    assert coordinator_bind("trainspec-0.trainspec:12355") == "trainspec-0.trainspec:12355"
    monkeypatch.setenv(COORDINATOR_BIND, "0.0.0.0")
    assert coordinator_bind("trainspec-0.trainspec:12355") == "0.0.0.0:12355"
    monkeypatch.setenv(COORDINATOR_BIND, "::")
    assert coordinator_bind("[fd00::1]:80") == "[::]:80"


@pytest.mark.parametrize("coordinator,gloo_host", [("127.0.0.1:1234", "127.0.0.1"),
                                                   ("trainspec-0.trainspec:1234", None)])
def test_xla_gloo_of_a_local_job_listens_on_loopback(monkeypatch, coordinator, gloo_host):
    """XLA:CPU's gloo would listen on the address the host's name resolves to (here the
    loopback one, so the job above cannot tell): a local job's CPU client names 127.0.0.1 to
    it; a multi-host job's is jax's own."""
    import jax
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    from trainspec.core.launch import COORDINATOR, NUM_PROCESSES, PROCESS_ID
    from trainspec.jax import runtime

    factories, made = {}, {}
    monkeypatch.setattr(xla_bridge, "register_backend_factory",
                        lambda name, factory, **_: factories.setdefault(name, factory))
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: None)
    monkeypatch.setattr(_jax, "make_gloo_tcp_collectives", lambda **kw: made.update(kw))
    monkeypatch.setattr(xla_bridge, "make_cpu_client", lambda collectives=None: "client")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=5")
    for name, value in ((COORDINATOR, coordinator), (NUM_PROCESSES, "2"), (PROCESS_ID, "0")):
        monkeypatch.setenv(name, value)
    assert runtime.initialize_from_env()
    if gloo_host is None:
        assert factories == {}
        return
    assert factories["cpu"]() == "client"
    assert made["hostname"] == gloo_host
