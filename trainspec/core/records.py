"""The metrics record format (versioned), its JSON Schema, and the JSONL writer and reader.

The schema is data, shipped with the package as trainspec/core/metrics.schema.json: the one
definition of every field (units are in the names; docs/metrics.md has the formulas). One record
per metrics interval, one JSON object per line. `schema` names the format and its version; a
reader MUST check it. Fields whose value is unknown on a backend are null, never absent, so that
every record of a version has the same keys.
"""
from __future__ import annotations

import errno
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from trainspec.core.errors import UserInputError

SCHEMA_PATH = Path(__file__).with_name("metrics.schema.json")
_SCHEMA = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))

SCHEMA_ID: str = _SCHEMA["$id"]
REQUIRED: tuple[str, ...] = tuple(_SCHEMA["required"])
# field -> its JSON Schema (with its description), in the schema's order.
FIELDS: dict[str, dict] = {name: _SCHEMA["properties"][name] for name in REQUIRED}
# Present only in the records they mark (absent, not null, elsewhere): a report draws the
# events of a run from them.
MARKS: dict[str, dict] = {name: field for name, field in _SCHEMA["properties"].items()
                          if name not in FIELDS}


def json_schema() -> dict[str, Any]:
    return json.loads(schema_text())  # a fresh copy: callers may change it


def schema_text() -> str:
    return SCHEMA_PATH.read_text(encoding="utf-8")


def finite_or_none(value):
    """JSON has no NaN/Infinity: a non-finite number is recorded as null."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class JsonlWriter:
    """One record per line, each whole or not at all: a record is one `os.write` of its whole
    line on an O_APPEND descriptor (no buffer to flush in pieces, every write lands at the
    current end, after a `rewind` too), and a write that fails or falls short (a full disk:
    ENOSPC, EDQUOT) is cut back to the length before it and raised as OSError. A kill in the
    middle of the one write can still tear its line; `read_jsonl` and `rewind` drop such a
    last line.

    Why not write each record to a temporary file and rename: a rename replaces the whole file
    (every record rewritten per record), and appending from a temporary file is the same
    single write again."""

    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        self._fd = os.open(path, flags if append else flags | os.O_TRUNC, 0o644)

    def write(self, record: dict) -> None:
        line = (json.dumps(record, allow_nan=False) + "\n").encode()
        end = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
        except OSError:
            self._cut_back(end)
            raise
        if written != len(line):  # short: the file system took only part of it
            self._cut_back(end)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    def _cut_back(self, end: int) -> None:
        """Leave the file as it was before the failed record: whole records only. Shrinking
        a file needs no new blocks, so it succeeds on a full disk."""
        os.ftruncate(self._fd, end)

    def rewind(self, step: int) -> dict[int, float]:
        """Cut the file after the last record at or before `step`, in place: the file is open
        in append mode, so the next record is written at the new end."""
        kept, losses = 0, {}
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # a line torn by a kill: drop it and what follows
                    break
                if record.get("step", 0) > step:
                    break
                kept += len(line)
                if record.get("loss") is not None:
                    losses[record["step"]] = record["loss"]
        os.truncate(self.path, kept)
        return losses

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_jsonl(path: Path) -> list[dict]:
    """Records of one run. A truncated last line (a writer that crashed mid-line) is skipped
    with a warning; any other bad line, or a record of another format version, is an error."""
    path = Path(path)
    if path.is_dir() and (path / "metrics.jsonl").is_file():  # a run directory
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise UserInputError(f"metrics file not found: {path}")
    try:
        lines = path.read_bytes().decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise UserInputError(f"{path}: not a metrics JSONL file (not UTF-8 text)") from None
    complete_last = lines[-1] == ""  # a file the writer finished ends with a newline
    lines = lines[:-1] if complete_last else lines
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) and not complete_last:
                warnings.warn(f"{path}: line {i} is truncated (an interrupted writer); skipped",
                              stacklevel=2)
                continue
            raise UserInputError(f"{path}: line {i} is not valid JSON") from None
        if not isinstance(record, dict) or record.get("schema") != SCHEMA_ID:
            got = record.get("schema") if isinstance(record, dict) else type(record).__name__
            raise UserInputError(f"{path}: line {i} is not a {SCHEMA_ID} record (schema {got!r})")
        if (wrong := _wrong_field(record)) is not None:
            raise UserInputError(f"{path}: line {i}: {wrong}")
        records.append(record)
    if not records:
        raise UserInputError(f"{path}: no metric records")
    return records


# JSON Schema's types as Python's (a bool is an int in Python, never a number in JSON).
_JSON_TYPES = {"number": (int, float), "integer": (int,), "string": (str,), "boolean": (bool,),
               "null": (type(None),), "object": (dict,), "array": (list,)}


def _wrong_field(record: dict) -> str | None:
    """What makes `record` not one of the schema's: a required field missing, or a field of
    another type than the schema's; None when it is one."""
    for name, field in {**FIELDS, **MARKS}.items():
        if name not in record:
            if name in FIELDS:
                return f"field {name!r} is missing"
            continue
        types = field.get("type")
        if types is None:  # a const or an enum: checked by value where it matters
            continue
        types = [types] if isinstance(types, str) else types
        value = record[name]
        if not any(isinstance(value, _JSON_TYPES[t]) and (t == "boolean" or not isinstance(
                value, bool)) for t in types):
            return (f"field {name!r} is {type(value).__name__} {json.dumps(value)[:40]}, "
                    f"expected {' or '.join(types)}")
    return None


def interval_fields(facts: dict, steps: int, wall_s: float, valid_tokens: float,
                    tokens_per_step: int, data_wait_s: float, goodput: dict) -> dict:
    """The timing fields of the record that ends an interval of `steps` steps in `wall_s`
    seconds, over the step's static `facts` (FLOPs, peak, devices, memory, comm), which it
    includes: throughput, MFU/HFU, input stalls and goodput (`Goodput.summary()`), the same
    arithmetic for every implementation."""
    from trainspec.core.flops import Peak, utilisation

    step_time = wall_s / steps
    peak = Peak(facts["peak_flops_per_device"], facts["peak_flops_source"])
    use = lambda key: utilisation(facts[key], step_time, facts["n_devices"], peak)  # noqa: E731
    return {
        "step_time_s": step_time,
        "tokens_per_s": valid_tokens / wall_s,
        "padded_tokens_per_s": tokens_per_step * steps / wall_s,
        **facts,
        "mfu": use("model_flops_per_step"),
        "hfu": use("hardware_flops_per_step"),
        "data_wait_s": data_wait_s,
        "data_wait_fraction": data_wait_s / wall_s if wall_s > 0 else 0.0,
        "elapsed_s": goodput["elapsed_s"],
        "goodput": goodput["goodput"],
        "badput_s": goodput["badput_s"],
    }


# The step's aux values the expert fields are made of (the model's raw sums): a record carries
# the fields, not these again under `aux`.
MOE_AUX = ("moe_load", "moe_dropped", "moe_balance", "moe_z", "moe_layers")


def user_aux(aux) -> dict:
    """A step's aux values less the experts' raw sums (MOE_AUX), which moe_fields reads."""
    return {k: v for k, v in aux.items() if k not in MOE_AUX} if isinstance(aux, dict) else aux


def moe_fields(aux) -> dict:
    """The expert fields of a record from a step's `aux` metrics, where the model reports them
    (trainspec.jax.models.moe: per-layer expert load and the dropped, balance and z sums with
    their count of layers x micro-batches); {} for a model without experts."""
    if not isinstance(aux, dict) or "moe_load" not in aux:
        return {}
    load = np.asarray(aux["moe_load"], np.float64).reshape(-1, np.shape(aux["moe_load"])[-1])
    count = float(aux["moe_layers"])
    return {
        "moe_load_max_over_mean": finite_or_none(np.max(load.max(1) / load.mean(1))),
        "moe_dropped_tokens": finite_or_none(aux["moe_dropped"]),
        "moe_load_balance_loss": finite_or_none(float(aux["moe_balance"]) / count),
        "moe_z_loss": finite_or_none(float(aux["moe_z"]) / count),
    }


def run_fields(facts: dict, seconds: float, timed_steps: int, valid_tokens: float,
               goodput: dict, losses: dict[int, float], last_step: int) -> dict:
    """A run summary's measured numbers: means over every recorded step (`seconds` of
    `timed_steps` steps training `valid_tokens`), the first and last recorded loss."""
    from trainspec.core.flops import Peak, utilisation

    step_time = seconds / timed_steps if timed_steps else float("nan")
    peak = Peak(facts["peak_flops_per_device"], facts["peak_flops_source"])
    return {
        # None only on a non-writer process resumed at the end (it recorded nothing itself)
        "initial_loss": losses[min(losses)] if losses else None,
        "final_loss": losses.get(last_step),
        "step_time_s": step_time,
        "tokens_per_s": valid_tokens / seconds if seconds else float("nan"),
        "mfu": utilisation(facts["model_flops_per_step"], step_time, facts["n_devices"], peak),
        "peak_flops_per_device": peak.flops_per_device,
        "peak_flops_source": peak.source,
        "model_flops_per_step": facts["model_flops_per_step"],
        "memory_peak_bytes": facts["memory_peak_bytes"],
        "comm_bytes_per_step": facts["comm_bytes_per_step"],
        "comm_bus_bytes_per_step": facts["comm_bus_bytes_per_step"],
        "comm_bytes_by_axis": facts.get("comm_bytes_by_axis"),
        "compile_time_s": facts["compile_time_s"],
        "goodput": goodput["goodput"],
        "badput_s": goodput["badput_s"],
    }
