"""Where a spec's data comes from: a TOML file or text, a dict, or nothing (the defaults), and
`--set key.path=value` overrides; trainspec.core.spec validates the result."""
from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path
from typing import Any

from trainspec.core.errors import UserInputError


def read_source(source: str | Path | dict[str, Any] | None) -> dict[str, Any]:
    """The unvalidated data of a TOML path, a TOML string, a dict (copied) or None."""
    if source is None:
        return {}
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, Path) or _looks_like_path(source):
        path = Path(source)
        if not path.is_file():
            raise UserInputError(f"spec file not found: {path}")
        return _parse_toml(_read_spec_file(path), str(path))
    return _parse_toml(source, "spec text")


def apply_overrides(data: dict[str, Any], overrides) -> None:
    for assignment in overrides:
        _apply_override(data, assignment)


def _looks_like_path(text: str) -> bool:
    return "\n" not in text and "=" not in text


def _parse_toml(text: str, origin: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserInputError(f"{origin} is not valid TOML: {err}") from None
    except RecursionError:  # tomllib recurses once per nesting level
        raise UserInputError(f"{origin} is not valid TOML: nested too deeply") from None


def _read_spec_file(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserInputError(f"spec file {path} is not UTF-8 text (TOML must be UTF-8): byte "
                             f"{err.start} is {err.object[err.start:err.start + 1]!r}") from None
    except OSError as err:
        raise UserInputError(f"spec file {path} cannot be read: {err.strerror}") from None


def _apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply `a.b.c=value`; the value is read as a TOML value, else taken as a string."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise UserInputError(f"--set expects key.path=value, got {assignment!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    path = key.strip().split(".")
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserInputError(f"--set {key}: '{part}' is not a table")
        node = child
    node[path[-1]] = value


def to_toml(data: dict[str, Any]) -> str:
    """A spec's data as TOML that reads back to the same data (`null` fields are left out:
    their default is null). tomllib only reads, and the spec needs no more than this."""
    lines: list[str] = []
    _toml_table(data, (), lines)
    return "\n".join(lines) + "\n"


def _toml_table(table: dict[str, Any], path: tuple[str, ...], lines: list[str]) -> None:
    values = {k: v for k, v in table.items() if v is not None and not isinstance(v, dict)}
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    if path and (values or not tables):  # an empty table is written, so that it reads back
        lines.append(f"\n[{'.'.join(_toml_key(k) for k in path)}]")
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in values.items()]
    for key, sub in tables.items():
        _toml_table(sub, (*path, key), lines)


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # inf and nan are TOML too
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")
