"""Join a multi-process job on JAX's own distributed runtime (gloo on CPU, NCCL on GPU).

Where the job is described, first match wins:
1. TRAINSPEC_COORDINATOR (host:port), TRAINSPEC_NUM_PROCESSES, TRAINSPEC_PROCESS_ID — set by
   `trainspec launch`, or by hand (trainspec.core.job_env: the process id defaults to
   JOB_COMPLETION_INDEX, the index of a pod in a Kubernetes Indexed Job);
2. a cluster that jax recognises by itself (SLURM's SLURM_* variables, Open MPI, ...) when
   TRAINSPEC_CLUSTER=auto is set: jax reads the coordinator, count and id from it;
3. otherwise: a single process, nothing to do.
docs/scale-out.md gives the commands for each.

Joining a job also bounds how long XLA:CPU's collectives across processes (gloo) wait for a peer
that does not arrive: `collectives.timeout_s`, where they would otherwise wait far longer.
"""
from __future__ import annotations

import json
import math
import os

import jax
import numpy as np

from trainspec.core.backend import Runtime
from trainspec.core.job_env import described_job, env_int
from trainspec.core.launch import (  # noqa: F401 (re-exported)
    COORDINATOR, NUM_PROCESSES, PROCESS_ID, coordinator_bind, split_host_port)
from trainspec.core.spec import DEFAULT_COLLECTIVE_TIMEOUT_S

CLUSTER = "TRAINSPEC_CLUSTER"
INIT_TIMEOUT = "TRAINSPEC_INIT_TIMEOUT_S"
# Read by XLA:CPU when jax creates its CPU client (the first device query); whole seconds.
# GPU collectives (NCCL) do not read it; it is harmless there.
CPU_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # a coordinator there: a job on this host


def initialize_from_env(collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> bool:
    """Initialise jax.distributed if the environment describes a multi-process job, with
    XLA:CPU's collectives across processes failing after `collective_timeout_s` (the spec's
    `collectives.timeout_s`) unless XLA_FLAGS already names that flag.

    Must run before jax's first device query. Returns whether a multi-process job was joined.
    """
    timeout = env_int(INIT_TIMEOUT) if os.environ.get(INIT_TIMEOUT) else 300
    job = described_job()
    if job is not None:
        _bound_cpu_collectives(collective_timeout_s)
        if split_host_port(job.coordinator)[0] in LOOPBACK_HOSTS:
            _gloo_listens_on("127.0.0.1")
        jax.distributed.initialize(
            job.coordinator, num_processes=job.processes, process_id=job.process_id,
            initialization_timeout=timeout,
            coordinator_bind_address=coordinator_bind(job.coordinator),
        )
        return True
    if os.environ.get(CLUSTER) == "auto":
        _bound_cpu_collectives(collective_timeout_s)
        jax.distributed.initialize(initialization_timeout=timeout)
        return True
    return False


def _gloo_listens_on(host: str) -> None:
    """XLA:CPU's gloo listens for its peers on the address this host's name resolves to (not
    always loopback); a job on this host alone has it listen on `host`. jax has no option for
    it, so its CPU client factory is replaced by one naming the host (the same private names in
    jax 0.10.2 to 0.12)."""
    from jax._src import config as jax_config, distributed, xla_bridge
    from jax._src.lib import _jax

    def cpu_client():
        if jax_config.cpu_collectives_implementation.value != "gloo":
            return xla_bridge.make_cpu_client()
        return xla_bridge.make_cpu_client(collectives=_jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname=host))

    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)


def _bound_cpu_collectives(timeout_s: float) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_COLLECTIVE_TIMEOUT_FLAG not in flags:  # one given by hand is the user's choice
        os.environ["XLA_FLAGS"] = (
            f"{flags} {CPU_COLLECTIVE_TIMEOUT_FLAG}={max(1, math.ceil(timeout_s))}").strip()


def is_writer() -> bool:
    """Whether this process writes the job's shared files (metrics, summary): process 0 only."""
    return jax.process_index() == 0


class JaxRuntime(Runtime):
    """The job's processes on jax.distributed; every device of a process is one of the job's."""

    def __init__(self, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        self.timeout_s = timeout_s

    def join(self) -> None:
        """Before jax's first device query (a no-op unless launched as one process of
        several, or already joined)."""
        if not jax.distributed.is_initialized():
            initialize_from_env(self.timeout_s)

    def process_grid(self) -> tuple[int, int]:
        return jax.process_index(), jax.process_count()

    def device_ids(self) -> list[int]:
        return [d.id for d in jax.devices()]

    def gather_objects(self, obj) -> list:
        if jax.process_count() == 1:
            return [obj]
        from jax.experimental import multihost_utils

        data = json.dumps(obj).encode()  # padded to the longest: the gather takes one shape
        size = int(np.max(multihost_utils.process_allgather(np.int64(len(data)))))
        every = multihost_utils.process_allgather(np.frombuffer(data.ljust(size), np.uint8))
        return [json.loads(bytes(row)) for row in np.asarray(every)]
