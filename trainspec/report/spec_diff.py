"""Which spec fields differ between the runs of a report: each run's `spec.toml` (the spec its
run directory was last trained under, overrides applied; trainspec/core/run_files.py), read as
written and flattened to dotted fields, so that a spec of another version still compares."""
from __future__ import annotations

import tomllib
from pathlib import Path

from trainspec.core.run_files import saved_spec

MISSING = "-"  # a field one run's spec does not have


def run_dir(path: Path) -> Path:
    """The run directory a report argument names: itself, or the directory of its metrics file."""
    path = Path(path)
    return path if path.is_dir() else path.parent


def flatten(table: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def run_spec(path: Path) -> dict[str, object] | None:
    """The run's spec as dotted fields, or None where its directory holds no spec.toml (a
    metrics file copied out of its run, or written by a loop of one's own)."""
    spec = saved_spec(run_dir(path))
    if spec is None:
        return None
    with spec.open("rb") as f:
        return flatten(tomllib.load(f))


def differences(specs: dict[str, dict | None]) -> list[tuple[str, list[str]]]:
    """(field, its value in each run) for every field whose values differ between the runs that
    have a spec, in the spec's order; values as TOML would show them."""
    known = [s for s in specs.values() if s is not None]
    if len(known) < 2:
        return []
    fields = list(dict.fromkeys(f for s in known for f in s))
    rows = []
    for field in fields:
        values = [_shown(s.get(field, MISSING)) if s is not None else MISSING
                  for s in specs.values()]
        if len({_shown(s.get(field, MISSING)) for s in known}) > 1:
            rows.append((field, values))
    return rows


def _shown(value) -> str:
    if value is MISSING:
        return MISSING
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def notes(specs: dict[str, dict | None]) -> list[str]:
    """A line per run without a spec, and one line when the runs' specs agree."""
    lines = [f"{name}: no spec.toml beside its records: its spec is not compared"
             for name, s in specs.items() if s is None]
    if sum(s is not None for s in specs.values()) >= 2 and not differences(specs):
        lines.append("spec: the runs' specs agree on every field")
    return lines


def table(specs: dict[str, dict | None]) -> str:
    """The terminal's spec diff: its notes, then a row per differing field, a column per run."""
    if len(specs) < 2:
        return ""
    rows = differences(specs)
    if not rows:
        return "\n".join(notes(specs))
    header = ["spec field", *specs]
    widths = [max(len(r[i]) for r in [header, *[[f, *v] for f, v in rows]])
              for i in range(len(header))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([*notes(specs), fmt(header), fmt(["-" * w for w in widths]),
                      *(fmt([f, *v]) for f, v in rows)])
