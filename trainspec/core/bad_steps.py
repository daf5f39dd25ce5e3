"""The `rollback` policy's decisions (health.nan.policy = "rollback", docs/reliability.md),
framework-free, so that every implementation judges a step by one rule.

A step is bad when its loss or gradient norm is not finite, or when its loss is a spike: above
median + k * MAD of the last good steps' losses (and `min_excess` above the median). The run
loop (trainspec.core.run) asks this module for a verdict on each step, a few steps late, rolls back
to the newest good checkpoint on a bad one and trains on without the offending batches: their
indices are left out of the data stream (`batch_index`), so the step after the checkpoint reads
the next batch not skipped. The state itself is checked before each checkpoint and at the end
(a non-finite element no loss showed starts a replay that checks every state, to name its step).
"""
from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterator
from typing import Any

from trainspec.core.health import HealthHalt, outlier_threshold
from trainspec.core.spec_health import NanSpec, SpikeSpec


class RollbackLimit(HealthHalt):
    """A bad step the rollback policy cannot train past: too many rollbacks, or no checkpoint
    to go back to. The newest checkpoint is the last good state (nothing is saved on the halt:
    the state in memory is the bad one)."""


def batch_index(position: int, skipped: frozenset[int] | set[int]) -> int:
    """The data index (0-based) the step at `position` (0-based) reads: the `position`-th
    index not in `skipped`."""
    index = position
    for s in sorted(skipped):
        if s <= index:
            index += 1
    return index


class LossSpikes:
    """The running window of good steps' losses and the spike rule over it."""

    def __init__(self, spec: SpikeSpec):
        self.spec = spec
        self.window: collections.deque[tuple[int, float]] = collections.deque(maxlen=spec.window)

    def threshold(self) -> float | None:
        """The loss above which a step is a spike; None until the window has enough steps."""
        if len(self.window) < min(self.spec.min_steps, self.spec.window):
            return None
        return outlier_threshold([loss for _, loss in self.window], self.spec.k,
                                 self.spec.min_excess)

    def add(self, step: int, loss: float) -> None:
        self.window.append((step, loss))

    def forget_after(self, step: int) -> None:
        """A rollback to `step`: the losses of the steps after it are gone with them."""
        kept = [(s, loss) for s, loss in self.window if s <= step]
        self.window.clear()
        self.window.extend(kept)


# When the run loop reads verdicts (docs/wrapping.md, "Why the default guard adds nothing to
# the step"). The host waits for none of the newest VERDICT_LAG steps, whose loss may still be
# in the making, and reads the older ones VERDICT_BATCH at a time: a wait made every tenth step
# costs half of one made every step (docs/results.md, "What wrap() costs"). A record, a
# checkpoint and the last step sync on their step anyway: every step still pending is judged
# there.
VERDICT_LAG, VERDICT_BATCH = 3, 10


class PendingVerdicts:
    """Steps dispatched but not yet judged, oldest first, each with its verdict inputs (the
    values `Step.read_verdicts` reads, still on the device). `lag` and `batch` are the
    constants above (the bench sets `batch=1` to time a read every step)."""

    def __init__(self, lag: int = VERDICT_LAG, batch: int = VERDICT_BATCH):
        self.lag, self.batch = lag, batch
        self._steps: collections.deque[tuple[int, Any]] = collections.deque()

    def add(self, step: int, inputs: Any) -> None:
        self._steps.append((step, inputs))

    def due(self, now: bool) -> list[tuple[int, Any]]:
        """The steps to judge now, taken off the queue: every one with `now`; else, once
        `batch` steps wait behind the newest `lag`, all but those newest."""
        keep = 0 if now else self.lag
        if not now and len(self._steps) < self.lag + self.batch:
            return []
        return [self._steps.popleft() for _ in range(len(self._steps) - keep)]

    def clear(self) -> None:
        self._steps.clear()


def verdict(step: int, finite: bool, loss: float | None, spikes: LossSpikes) -> str | None:
    """Why step `step` is bad, or None (a good step's loss joins the window). `finite`: the
    gradient norm; `loss`: the step's loss on the host."""
    if not finite or (loss is not None and not math.isfinite(loss)):
        return f"non-finite loss or gradients at step {step}"
    if loss is None:
        return None
    limit = spikes.threshold()
    if limit is not None and loss > limit:
        return (f"loss spike at step {step}: {loss:.4g} > {limit:.4g} (median + "
                f"{spikes.spec.k:g} MAD of the last {len(spikes.window)} good steps)")
    spikes.add(step, loss)
    return None


def bad_verdicts(due: list[tuple[int, Any]], read_verdicts: Callable[[list], list],
                 spikes: LossSpikes) -> Iterator[tuple[int, str]]:
    """(step, why) for each bad step of `due` (PendingVerdicts.due), oldest first, their
    inputs read in one `read_verdicts` (the implementation's Step.read_verdicts). Lazy: a
    caller that stops at the first bad step leaves the later ones out of the spike window."""
    verdicts = read_verdicts([inputs for _, inputs in due]) if due else []
    for (step, _), (finite, loss) in zip(due, verdicts):
        reason = verdict(step, finite, loss, spikes)
        if reason is not None:
            yield step, reason


def batches_to_skip(policy: NanSpec, bad_step: int, restored_step: int,
                    skipped: set[int]) -> list[int]:
    """The data indices a rollback from `bad_step` to `restored_step` skips: the bad step's
    batch and the `skip_batches - 1` before it, none at or before the restored step's."""
    first = max(restored_step + 1, bad_step - policy.skip_batches + 1)
    return [batch_index(position - 1, skipped) for position in range(first, bad_step + 1)]


def halt_line(policy: NanSpec, reason: str, rollbacks: int, last_checkpoint: int | None,
              directory) -> RollbackLimit | None:
    """The halt for a bad step the policy cannot roll back from, or None when it can."""
    if last_checkpoint is None:
        return RollbackLimit(f"{reason}, and no checkpoint to roll back to (the first is "
                             "written at checkpoint.interval; health.nan.policy = skip drops "
                             "a non-finite step without one)", 0)
    if rollbacks >= policy.max_rollbacks:
        return RollbackLimit(f"{reason} after {rollbacks} rollbacks (health.nan.max_rollbacks "
                             f"= {policy.max_rollbacks}); the last good state is checkpoint "
                             f"{last_checkpoint} in {directory}", last_checkpoint)
    return None
