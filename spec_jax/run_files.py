"""Files of a run directory that every implementation writes alike. Framework-free."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomically(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees a half-written summary
