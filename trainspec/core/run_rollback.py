"""The rollbacks of a run (trainspec.core.run.Run, which this class is a part of, kept apart by
concern): under `health.nan.policy = rollback`, each step judged a few steps late by its loss and
gradient norm (trainspec.core.bad_steps) and, on a bad one, back to the newest good checkpoint
with the offending batches skipped from then on; a non-finite state that no step showed, replayed
from that checkpoint to find the step that made it; on a replica fingerprint mismatch under
`health.fingerprints.policy = rollback`, back onto the devices left. Every rollback is listed in
the summary."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainspec.core import bad_steps
from trainspec.core.backend import Engine
from trainspec.core.health import ReplicaMismatch, StragglerDetector, rolls_back

# What the loop trains: (step, target, init, data) as `restore` and `batches` take them.
Job = tuple[Engine, Any, Callable[[], Any], Callable[[int], dict]]


class Rollbacks:
    """The rollback half of Run: its state is initialised by `_init_rollbacks`; the rest of the
    run (the step, state, checkpoints, records, data) is Run's."""

    def _init_rollbacks(self, spec) -> None:
        self.rollbacks: list[dict] = []
        # health.nan.policy = rollback: the data indices left out of the stream, the loss
        # window of the spike rule, and the step whose verdict is still to be read
        self.rolls_back = rolls_back(spec.health.nan)
        self.skipped_batches: set[int] = set()
        self.spikes = bad_steps.LossSpikes(spec.health.spikes)
        self._pending = bad_steps.PendingVerdicts()
        self._search_until = 0  # a non-finite state's search: check every state to this step
        self._bad_step_rollbacks = 0
        self.rollback_mark: dict | None = None

    # -- bad steps (health.nan.policy = rollback) ------------------------------------------
    def _rolled_back_after_bad_step(self, metrics: dict, now: bool) -> bool:
        """Judge the steps whose verdict is due (bad_steps.PendingVerdicts: a few steps late,
        in batches) by their loss and gradient norm; with `now` (a checkpoint or the last
        step follows) every step not yet judged, this one too, waiting for it, and then the
        state itself, so that no checkpoint and no final state holds a non-finite element.
        While a search for the step that made a non-finite state is on, every step is judged
        so. On a bad step, roll back; returns whether it did."""
        inputs = self.step.verdict_inputs(metrics) if self.rolls_back else None
        if inputs is None:  # no rollback policy, or a step without the guard
            return False
        searching = self.at <= self._search_until
        now = now or searching
        self._pending.add(self.at, inputs)
        # a record reads this step's metrics anyway: judging every pending step first adds
        # no wait
        due = self._pending.due(now or self.recorder.due(self.at))
        for step, reason in bad_steps.bad_verdicts(due, self.step.read_verdicts, self.spikes):
            self._roll_back_bad_step(step, reason)
            return True
        if now and not self.step.state_is_finite(self.state):
            if searching:  # every state since the checkpoint was checked: this step made it
                self._roll_back_bad_step(self.at, f"non-finite state after step {self.at}")
            else:
                self._search_for_bad_step()
            return True
        return False

    def _roll_back_bad_step(self, bad: int, reason: str) -> None:
        """Back to the newest good checkpoint, the bad step's batches skipped from then on, or
        the halt when there is none or the policy's rollbacks are spent."""
        self._halt_unless_rollback_possible(reason)
        self._bad_step_rollbacks += 1
        # The batches are those after the checkpoint restored, known only once it has read
        # back: the newest (`last_saved`) may prove bad and be passed over for an older one.
        skipped = self.roll_back(reason, (self.step, *self._job, self._data), skip=lambda at: (
            bad_steps.batches_to_skip(self.spec.health.nan, bad, at, self.skipped_batches)))
        self.rollbacks[-1].update(bad_step=bad, skipped_batches=skipped)
        self.rollback_mark = {"rolled_back_from_step": bad}

    def _search_for_bad_step(self) -> None:
        """A non-finite state that no step's loss or gradient norm showed (a parameter the
        loss does not read, an update that overflowed): some step since the newest checkpoint
        made it, and which one is not known. Back to that checkpoint with nothing skipped,
        the state checked after every step up to this one: the first non-finite state names
        its step, which is then rolled back from like any bad step. The search is not counted
        against health.nan.max_rollbacks (the rollback it ends in is); it cannot repeat
        without a new finding at a later step."""
        found = self.at
        reason = (f"non-finite state at step {found}, which no loss or gradient norm showed: "
                  "replayed with the state checked after every step")
        self._halt_unless_rollback_possible(reason)
        self._search_until = found
        self.roll_back(reason, (self.step, *self._job, self._data))
        self.rollbacks[-1].update(bad_step=None, skipped_batches=[], searched_to_step=found)

    def _halt_unless_rollback_possible(self, reason: str) -> None:
        self._timed_checkpoint_io(self.ckpt.wait)  # `last_saved` is then complete
        halt = bad_steps.halt_line(self.spec.health.nan, reason, self._bad_step_rollbacks,
                                   self.ckpt.last_saved, self.ckpt.directory)
        if halt is not None:
            raise halt

    # -- replicas, rollback -------------------------------------------------------------------
    def _rolled_back_after_divergence(self, checkpointing: bool = False) -> bool:
        """Compare replica fingerprints when due (always before a checkpoint, which must never
        hold a corrupted replica). On a mismatch under `rollback` with a `rebuild`: roll back
        onto the devices left; returns whether it did."""
        checkpointing = checkpointing or self.ckpt.due(self.at, self.steps)
        n = self.step.spec.health.fingerprints.interval
        if not ((n > 0 and self.at % n == 0) or checkpointing):
            return False
        try:
            self.step.check_replicas(self.state, self.at, self.ckpt.last_saved)
            return False
        except ReplicaMismatch as err:
            if self.step.spec.health.fingerprints.policy == "halt" or self.rebuild is None:
                raise
            self.roll_back(str(err), self.rebuild(err.devices), excluded=err.devices)
            return True

    def roll_back(self, reason: str, job: Job, excluded: list[int] = (),
                  skip: Callable[[int], list[int]] | None = None) -> list[int]:
        """Go back to the newest good checkpoint on `job` (a step, the target its state is
        placed like, its `init()` when there is none, its data) and train on from there: the
        steps since are lost progress, their records are redone. Every rollback is listed in
        the summary with its `reason`. `skip(restored step)`: the data indices to leave out
        from then on, added to `skipped_batches` before the first batch is read; returned."""
        self.rollbacks.append({"step": self.at, "excluded": list(excluded), "reason": reason})
        self._timed_checkpoint_io(self.ckpt.wait)
        diverged_at = self.at
        step, target, init, self._data = job
        self.restore(step, target, init)
        self.rollbacks[-1]["restored_step"] = self.at
        skipped = skip(self.at) if skip is not None else []
        self.skipped_batches.update(skipped)
        if step.participants != self.stragglers.participants:  # processes were left out
            self.stragglers = StragglerDetector(self.spec.health.stragglers, step.participants)
            self._times.clear()
        self.goodput.lose_steps(diverged_at - self.at)
        self._prefetched = self._batch(self.at)
        self._open_records(self._prefetched)
        return skipped
