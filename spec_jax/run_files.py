"""Files of a run directory that every implementation writes alike: the summary JSON, and the
metrics JSONL cut back to the resumed step. Framework-free."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomically(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees a half-written summary


def drop_records_after(path: Path, step: int) -> None:
    """Cut metric records past `step` (work redone after a resume) in place, so that a sink
    open in append mode keeps writing at the new end."""
    if not path.exists():
        return
    keep = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) > step:
                    break
            except ValueError:  # a line torn by a kill: drop it and what follows
                break
            keep += len(line)
    os.truncate(path, keep)


def recorded_losses(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    records = (json.loads(line) for line in path.read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if r.get("loss") is not None}
