"""The one-line messages of a spec that does not validate (trainspec.core.spec's load_spec)."""
from __future__ import annotations

import difflib
from typing import Any

import pydantic


def _known_fields(loc: tuple, model: Any) -> list[str]:
    """Field names of the section that holds `loc` (for "did you mean")."""
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        model = field.annotation if field is not None else None
    return list(getattr(model, "model_fields", {}))


def validation_message(err: pydantic.ValidationError, model: Any) -> str:
    """One line for every error pydantic found validating `model`: the field, what is wrong
    and the value given; an unknown field gets a "did you mean" from its section's fields."""
    parts = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or getattr(e.get("ctx", {}).get("error"),
                                                              "field", "the spec")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(e["loc"][-1]), _known_fields(e["loc"], model), n=1)
            msg = "unknown field" + (f" (did you mean '{close[0]}'?)" if close else "")
        shown = repr(e["input"]) if not isinstance(e["input"], dict) else None
        parts.append(f"field '{field}': {msg}" + (f" (got {shown})" if shown else ""))
    return "invalid spec: " + "; ".join(parts)
