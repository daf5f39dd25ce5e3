"""The metrics record format (versioned), its JSON Schema, and the JSONL writer and reader.

The schema is committed as docs/metrics.schema.json (`python -m spec_jax.core.schema metrics`).
One record per metrics interval, one JSON object per line. `schema` names the format and its
version; a reader MUST check it. Fields whose value is unknown on a backend are null, never
absent, so that every record of a version has the same keys.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

from spec_jax.core.errors import UserInputError

SCHEMA_ID = "trainspec.metrics/1"

_num = {"type": "number"}
_num_or_null = {"type": ["number", "null"]}
_int_or_null = {"type": ["integer", "null"]}
_bytes_map = {"type": "object", "additionalProperties": {"type": "number", "minimum": 0}}

# field -> (JSON Schema, description). Units are in the names (docs/metrics.md has formulas).
FIELDS: dict[str, tuple[dict, str]] = {
    "schema": ({"const": SCHEMA_ID}, "Record format and version."),
    "step": ({"type": "integer", "minimum": 1}, "Optimizer step this record ends at."),
    "steps_in_interval": ({"type": "integer", "minimum": 1}, "Steps since the previous record."),
    "time": (_num, "Unix time of the record (s)."),
    "loss": (_num_or_null, "Loss of `step` (null if not finite)."),
    "grad_norm": (_num_or_null, "Global gradient norm of `step`, when the step reports it."),
    "learning_rate": (_num_or_null, "The schedule's learning rate for the update of `step` "
                      "(null when the trainer does not know the step's schedule)."),
    "step_time_s": (_num_or_null, "Mean wall time per step over the interval (s)."),
    "tokens_per_s": (_num_or_null, "Valid (unmasked) tokens per second over the interval."),
    "padded_tokens_per_s": (_num_or_null, "Token positions (padding included) per second."),
    "model_flops_per_step": (_num_or_null, "Analytic model FLOPs of one step (`flops_convention`)."),
    "flops_convention": ({"enum": ["no_causal_discount", "causal_discount", None]},
                         "Attention counting of `model_flops_per_step`."),
    "hardware_flops_per_step": (_num_or_null, "FLOPs the implementation executes (analytic: "
                                "embedding matmul, remat recomputation, no causal discount)."),
    "xla_flops_per_step": (_num_or_null, "XLA cost analysis of the step before partitioning."),
    "mfu": (_num_or_null, "model_flops_per_step / (step_time_s x n_devices x peak)."),
    "hfu": (_num_or_null, "hardware_flops_per_step / (step_time_s x n_devices x peak)."),
    "peak_flops_per_device": (_num_or_null, "Peak FLOP/s of one device used by mfu/hfu."),
    "peak_flops_source": ({"type": "string"}, "Where the peak came from."),
    "n_devices": ({"type": "integer", "minimum": 1}, "Devices the step runs on."),
    "memory_peak_bytes": (_int_or_null, "Per device: arguments + outputs - aliased + temporaries."),
    "memory_argument_bytes": (_int_or_null, "Per device: input buffers of the step."),
    "memory_output_bytes": (_int_or_null, "Per device: output buffers of the step."),
    "memory_alias_bytes": (_int_or_null, "Per device: outputs aliasing donated inputs."),
    "memory_temp_bytes": (_int_or_null, "Per device: temporaries of the step."),
    "memory_generated_code_bytes": (_int_or_null, "Per device: generated code."),
    "memory_xla_peak_bytes": (_int_or_null, "XLA's own peak estimate, as reported."),
    "memory_live_bytes": (_int_or_null, "Largest bytes in use on a local device now (allocator)."),
    "comm_bytes_per_step": (_num_or_null, "Per device: sum of collective payloads S per step."),
    "comm_bus_bytes_per_step": (_num_or_null, "Per device: S x nccl-tests bus factor, summed."),
    "comm_bytes_by_kind": (_bytes_map, "comm_bytes_per_step by collective kind."),
    "comm_bytes_by_axis": (_bytes_map, "comm_bytes_per_step by mesh axes spanned ('a+b')."),
    "data_wait_s": (_num, "Host time waiting for input over the interval (s)."),
    "data_wait_fraction": (_num, "data_wait_s / wall time of the interval."),
    "compile_time_s": (_num_or_null, "Lowering + compilation of the step (s)."),
    "elapsed_s": (_num, "Time since the run started (s)."),
    "goodput": (_num_or_null, "Productive step time / elapsed_s, so far."),
    "badput_s": ({"type": "object", "additionalProperties": {"type": "number"}},
                 "Non-productive seconds by category, so far."),
    "batch_tokens": ({"type": "integer", "minimum": 1},
                     "Token positions per optimizer step (global_batch x seq_len)."),
    "gns_source": ({"enum": ["replicas", "micro_batches", None]},
                   "Small batch of the noise-scale estimate; null = not measured (metrics.gns)."),
    "gns_grad_sq": (_num_or_null, "|G|^2 estimate, bias-corrected EMA over all steps so far "
                    "(gradient of the mean per-token loss; docs/advice.md)."),
    "gns_trace": (_num_or_null, "tr(Sigma) estimate (per token), bias-corrected EMA so far."),
    "gns": (_num_or_null, "Gradient noise scale B_simple = gns_trace / gns_grad_sq, in tokens "
            "(null until gns_grad_sq > 0)."),
}

REQUIRED = tuple(FIELDS)

# Present only in the records they mark (absent, not null, elsewhere): a report draws the
# events of a run from them.
MARKS: dict[str, tuple[dict, str]] = {
    "resumed_from_step": ({"type": "integer", "minimum": 0},
                          "On the first record after a resume: the checkpoint's step."),
    "resumed_from_mesh": ({"type": "string"}, "On the first record after a resume: the mesh "
                          "the checkpoint was written on ('data=8 x fsdp=1 x tensor=1')."),
    "checkpoint_saved": ({"const": True}, "On the record of a step after which a checkpoint "
                         "of that step was saved."),
}


def json_schema() -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "trainspec metrics record, version 1",
        "description": "One JSON object per line of a metrics JSONL file (docs/metrics.md).",
        "type": "object",
        "properties": {name: {**schema, "description": desc}
                       for name, (schema, desc) in {**FIELDS, **MARKS}.items()},
        "required": list(REQUIRED),
        "additionalProperties": True,  # later minor additions do not break version-1 readers
    }


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def finite_or_none(value):
    """JSON has no NaN/Infinity: a non-finite number is recorded as null."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class JsonlWriter:
    """One record per line, flushed per record: a crash loses at most the line being written
    (`read_jsonl` skips a truncated last line)."""

    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # Always append mode, so that writes follow a `rewind`; a new run starts empty.
        self._file = open(path, "a")
        if not append:
            self._file.truncate(0)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

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
        self._file.close()


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
        records.append(record)
    if not records:
        raise UserInputError(f"{path}: no metric records")
    return records


def interval_fields(facts: dict, steps: int, wall_s: float, valid_tokens: float,
                    tokens_per_step: int, data_wait_s: float, goodput: dict) -> dict:
    """The timing fields of the record that ends an interval of `steps` steps in `wall_s`
    seconds, over the step's static `facts` (FLOPs, peak, devices, memory, comm), which it
    includes: throughput, MFU/HFU, input stalls and goodput (`Goodput.summary()`), the same
    arithmetic for every implementation."""
    from spec_jax.core.flops import Peak, utilisation

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


def run_fields(facts: dict, seconds: float, timed_steps: int, valid_tokens: float,
               goodput: dict, losses: dict[int, float], last_step: int) -> dict:
    """A run summary's measured numbers: means over every recorded step (`seconds` of
    `timed_steps` steps training `valid_tokens`), the first and last recorded loss."""
    from spec_jax.core.flops import Peak, utilisation

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
        "compile_time_s": facts["compile_time_s"],
        "goodput": goodput["goodput"],
        "badput_s": goodput["badput_s"],
    }
