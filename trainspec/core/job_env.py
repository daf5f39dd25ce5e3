"""The job the environment describes, read alike by every backend (framework-free).

`trainspec launch` sets TRAINSPEC_COORDINATOR (host:port), TRAINSPEC_NUM_PROCESSES and
TRAINSPEC_PROCESS_ID; set by hand, the process id defaults to JOB_COMPLETION_INDEX, the index
of a pod in a Kubernetes Indexed Job, so that one pod template serves every process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from trainspec.core.errors import UserInputError
from trainspec.core.launch import COORDINATOR, NUM_PROCESSES, PROCESS_ID

INDEXED_JOB = "JOB_COMPLETION_INDEX"


@dataclass(frozen=True)
class Job:
    coordinator: str  # host:port
    processes: int
    process_id: int


def env_int(name: str, fallback: str | None = None) -> int:
    """The integer in environment variable `name` (else in `fallback`); UserInputError naming
    the variable when it is not one."""
    raw = os.environ.get(name, os.environ.get(fallback, "") if fallback else "")
    try:
        return int(raw)
    except ValueError:
        raise UserInputError(f"environment variable {name}: expected an integer, got {raw!r}") from None


def described_job() -> Job | None:
    """The job TRAINSPEC_COORDINATOR and its companions describe, None when it is not set;
    UserInputError when the process id is not one of the job's."""
    if not os.environ.get(COORDINATOR):
        return None
    processes = env_int(NUM_PROCESSES)
    process_id = env_int(PROCESS_ID, fallback=INDEXED_JOB)
    if not 0 <= process_id < processes:
        raise UserInputError(f"{PROCESS_ID}={process_id} is outside [0, {NUM_PROCESSES}={processes})")
    return Job(os.environ[COORDINATOR], processes, process_id)


def process_id_from_env(*others: str) -> int:
    """This process's id as its launcher set it: TRAINSPEC_PROCESS_ID, JOB_COMPLETION_INDEX
    under a TRAINSPEC_COORDINATOR, then the `others` (torchrun's RANK); 0 when none is set."""
    names = (PROCESS_ID, *([INDEXED_JOB] if os.environ.get(COORDINATOR) else []), *others)
    for name in names:
        if os.environ.get(name):
            return env_int(name)
    return 0
