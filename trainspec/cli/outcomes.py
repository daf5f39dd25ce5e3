"""How a command ends, for every command and backend alike: each outcome the trunk raises,
the line it prints (on stderr, `trainspec: ...`), by whom, and the exit status.

A line about the job (a halt, a stop, a run already trained) is said once, by the process that
speaks for the job; a line about this process (left out of the job, bad input it was given) by
the process itself.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable

from trainspec.core.errors import (
    FfiVersionError, JobLeavesNow, LeaveNow, LeftOut, UserInputError)
from trainspec.core.health import HealthHalt
from trainspec.core.loop import Preempted
from trainspec.core.run_files import AlreadyTrained
from trainspec.core.store import CheckpointRefusal


@dataclasses.dataclass(frozen=True)
class Outcome:
    kind: type[BaseException]
    status: Callable[[BaseException], int]
    prefix: str             # after "trainspec: "
    for_the_job: bool       # said only by the process that speaks for the job
    leave_now: bool = False  # exit without waiting for the framework's threads


# A process that does not speak for the job, leaving at once, would have the launcher stop the
# one that does before it has said why.
SPEAKER_FIRST_S = 5.0


# First match wins: subclasses before their bases (LeaveNow is a UserInputError).
OUTCOMES = (
    Outcome(AlreadyTrained, lambda _: 0, "", for_the_job=True),  # where it was asked to be
    Outcome(LeftOut, lambda _: 0, "", for_the_job=False),  # the others train on without it
    Outcome(HealthHalt, lambda _: 3, "halted: ", for_the_job=True),  # where the good state is
    Outcome(Preempted, lambda stop: stop.exit_status, "stopped: ", for_the_job=True),
    Outcome(JobLeavesNow, lambda _: 2, "error: ", for_the_job=True, leave_now=True),
    Outcome(LeaveNow, lambda _: 2, "error: ", for_the_job=False, leave_now=True),
    # every process decides it alike, from the same files and spec
    Outcome(CheckpointRefusal, lambda _: 2, "error: ", for_the_job=True),
    Outcome(UserInputError, lambda _: 2, "error: ", for_the_job=False),
    Outcome(FfiVersionError, lambda _: 1, "error: ", for_the_job=False),
)


def outcome_of(err: BaseException) -> Outcome | None:
    return next((o for o in OUTCOMES if isinstance(err, o.kind)), None)


def end(outcome: Outcome, err: BaseException, speaks_for_job: bool) -> int:
    """Say `err` as `outcome` says, and return its exit status (or leave now)."""
    says = speaks_for_job or not outcome.for_the_job
    if says:
        print(f"trainspec: {outcome.prefix}{err}", file=sys.stderr, flush=True)
    if outcome.leave_now:
        if not says:
            time.sleep(SPEAKER_FIRST_S)
        sys.stdout.flush()
        os._exit(outcome.status(err))
    return outcome.status(err)
