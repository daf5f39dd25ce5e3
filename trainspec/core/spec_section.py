"""The base of every section of the spec (trainspec.core.spec): one strictness for all fields."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # allow_inf_nan=False: inf and nan are refused in every float field (a learning rate of
    # inf validated, then made every parameter NaN after one step).
    # strict=True: a TOML string or boolean is never coerced to a number (global_batch = "32"
    # validated as 32, and global_batch = true as 1).
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              allow_inf_nan=False, strict=True)
