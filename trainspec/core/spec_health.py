"""The spec's `[health]` sections: the guards that keep a long run alive (docs/reliability.md)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainspec.core.spec_bounds import MAX_STEPS
from trainspec.core.spec_section import Section


class NanSpec(Section):
    """What a bad step (non-finite loss, gradient or state; under `rollback` also a loss
    spike) does to the run (docs/reliability.md)."""

    policy: Literal["rollback", "skip", "halt"] = Field(
        "rollback", description="On a bad step: `rollback` (the step adds no work; the host "
        "judges each step a few steps late) restores the newest good checkpoint and skips the "
        "offending batches; `skip` drops a non-finite update inside the step (it keeps the old "
        "state until a verdict: a copy and an all-reduce per step); `halt` stops with the last "
        "good state checkpointed."
    )
    max_consecutive_skips: int = Field(
        5, ge=1, le=MAX_STEPS,
        description="Under `skip`, one more consecutive non-finite step halts."
    )
    max_rollbacks: int = Field(
        3, ge=0, le=MAX_STEPS,
        description="Under `rollback`, one more bad step halts the invocation (a "
        "lasting loss rise makes every step a spike)."
    )
    skip_batches: int = Field(
        1, ge=1, le=MAX_STEPS,
        description="Under `rollback`, batches skipped per rollback: the bad step's "
        "and the ones just before it, none at or before the restored checkpoint."
    )


class SpikeSpec(Section):
    """Under `health.nan.policy = rollback`: the rule that calls a finite loss a spike."""

    window: int = Field(
        50, ge=3, le=MAX_STEPS, description="Recent good steps' losses the rule looks at.")
    k: float = Field(6.0, gt=0, description="Spike: loss > median + k * MAD of the window.")
    min_excess: float = Field(
        0.1, ge=0, description="...and more than this fraction above the median (MAD can be ~0)."
    )
    min_steps: int = Field(
        20, ge=3, le=MAX_STEPS,
        description="Good steps in the window before any loss is called a spike."
    )


class FingerprintSpec(Section):
    """Replica fingerprints: copies that should be identical, checked for silent corruption."""

    interval: int = Field(
        100, ge=0, le=MAX_STEPS,
        description="Steps between replica fingerprint checks (0 = off); state is "
        "also checked before every checkpoint."
    )
    policy: Literal["halt", "rollback"] = Field(
        "rollback", description="On a mismatch: `halt`, or exclude the diverged devices and "
        "resume from the last checkpoint."
    )


class StragglerSpec(Section):
    """The rule that names a participant whose steps are outliers."""

    window: int = Field(
        20, ge=3, le=MAX_STEPS, description="Steps of timings the outlier rule looks at.")
    k: float = Field(5.0, gt=0, description="Outlier: time > median + k * MAD.")
    min_excess: float = Field(
        0.1, ge=0, description="...and more than this fraction above the median (MAD can be ~0)."
    )


class HealthSpec(Section):
    """The guards that keep a long run alive (docs/reliability.md)."""

    preflight: bool = Field(
        False, description="Run `trainspec doctor`'s per-device numerics checks at start-up and "
        "exclude the devices that fail (as `--exclude-devices`); the time counts as "
        "initialisation badput."
    )
    nan: NanSpec = NanSpec()
    spikes: SpikeSpec = SpikeSpec()
    fingerprints: FingerprintSpec = FingerprintSpec()
    stragglers: StragglerSpec = StragglerSpec()
