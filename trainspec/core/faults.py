"""Fault injection: the run loop's test hook, to prove each guard catches its fault (tests,
notebook 04). Framework-free: the loop (trainspec.core.run) applies the faults it can itself and
asks the implementation's step to corrupt its own state.

`train.run(..., faults=Faults(...))` in process; a `trainspec train` subprocess (and every rank
of a torch job) reads the same fields as JSON from the TRAINSPEC_FAULTS environment variable.
Nothing is injected by default.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from trainspec.core.errors import UserInputError

ENV = "TRAINSPEC_FAULTS"


class InjectedCrash(RuntimeError):
    """Raised by `Faults.crash_at`: the process dies between steps (in-process stand-in for a
    kill; the real `kill -9` is tested on a subprocess)."""


@dataclasses.dataclass(frozen=True)
class Faults:
    nan_steps: frozenset[int] = frozenset()  # these steps' batches carry NaN in a float input
    spike_steps: frozenset[int] = frozenset()  # these steps' batches have every target byte
                                               # 255, which source text never has: a finite
                                               # loss far above the recent ones
    bitflip: tuple[int, int] | None = None   # (step, device id or rank): after that step, flip
                                              # one bit of that device's copy of the first parameter
    delay_s: float = 0.0                      # extra host time per step ...
    delay_process: int = 0                    # ... in this process ...
    delay_steps: frozenset[int] | None = None  # ... at these steps (None: every step)
    crash_at: int | None = None               # raise InjectedCrash after this step
    faulty_reduction: tuple[int, int] | None = None  # (device id, block): the JAX doctor's and
                                              # preflight's reductions on that device drop
                                              # the last partial block of that many elements

    @classmethod
    def from_env(cls) -> Faults:
        try:
            raw = json.loads(os.environ.get(ENV, "{}"))
            for key in ("nan_steps", "spike_steps", "delay_steps"):
                if raw.get(key) is not None:
                    raw[key] = frozenset(raw[key])
            for key in ("bitflip", "faulty_reduction"):
                if raw.get(key) is not None:
                    raw[key] = tuple(raw[key])
            return cls(**raw)
        except (ValueError, TypeError, AttributeError) as err:  # not JSON, not an object, a
            # field that is not one of these, or a value of the wrong shape
            fields = ", ".join(f.name for f in dataclasses.fields(cls))
            raise UserInputError(f"environment variable {ENV}: expected a JSON object with "
                                 f"fields among {fields} ({err})") from None

    def batch(self, step: int, batch: dict) -> dict:
        """Batch `step - 1` of the data (the batch step `step` reads in a run that skips
        none), with the faults planted in it."""
        if step in self.nan_steps:
            batch = {**batch, "mask": np.full_like(batch["mask"], np.nan)}
        if step in self.spike_steps:
            batch = {**batch, "targets": np.full_like(batch["targets"], 255)}
        return batch

    def delay(self, step: int, process_index: int) -> None:
        if self.delay_s and process_index == self.delay_process and (
            self.delay_steps is None or step in self.delay_steps
        ):
            time.sleep(self.delay_s)

    def crash(self, step: int) -> None:
        if step == self.crash_at:
            raise InjectedCrash(f"injected crash after step {step}")

    def bitflip_target(self, step: int) -> int | None:
        """The device (or rank) whose copy to corrupt after `step`, if any."""
        return self.bitflip[1] if self.bitflip is not None and self.bitflip[0] == step else None
