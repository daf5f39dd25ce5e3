"""The spec's `[health]` sections: the guards that keep a long run alive (docs/reliability.md)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainspec.core.spec_section import Section


class NanSpec(Section):
    """What a non-finite loss, gradient or state does to the run (docs/reliability.md)."""

    policy: Literal["skip", "halt"] = Field(
        "skip", description="On a non-finite loss or gradient: `skip` drops the update, "
        "`halt` stops with the last good state checkpointed."
    )
    max_consecutive_skips: int = Field(
        5, ge=1, description="Under `skip`, one more consecutive non-finite step halts."
    )


class FingerprintSpec(Section):
    """Replica fingerprints: copies that should be identical, checked for silent corruption."""

    interval: int = Field(
        100, ge=0, description="Steps between replica fingerprint checks (0 = off); state is "
        "also checked before every checkpoint."
    )
    policy: Literal["halt", "rollback"] = Field(
        "rollback", description="On a mismatch: `halt`, or exclude the diverged devices and "
        "resume from the last checkpoint."
    )


class StragglerSpec(Section):
    """The rule that names a participant whose steps are outliers."""

    window: int = Field(20, ge=3, description="Steps of timings the outlier rule looks at.")
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
    fingerprints: FingerprintSpec = FingerprintSpec()
    stragglers: StragglerSpec = StragglerSpec()
