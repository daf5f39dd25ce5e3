"""Where records go, for every implementation. JSONL always (trainspec.core.records.JsonlWriter);
TensorBoard under `metrics.tensorboard`, written by tensorboardX (the `tensorboard` extra, which
needs neither TensorFlow nor a framework); the sinks `metrics.sinks` names, found under the
`trainspec.sinks` entry points: the package's own W&B and MLflow sinks (sinks_wandb.py,
sinks_mlflow.py) and any other package's.

A sink is any object with `write(record: dict)`, `rewind(step)` and `close()`
(trainspec.core.recorder.Sink).
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from trainspec.core.errors import UserInputError
from trainspec.core.records import JsonlWriter
from trainspec.core.recorder import Sink
from trainspec.core.registry import declared


def _summary_writer_class():
    try:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    except ImportError:
        return None


# Record fields -> TensorBoard (docs/metrics.md, section 1). Scalars at every record:
PER_RECORD = {
    "loss": "loss/loss", "eval_loss": "loss/eval_loss", "grad_norm": "loss/grad_norm", "learning_rate": "loss/learning_rate",
    "gns": "loss/gns", "gns_grad_sq": "loss/gns_grad_sq", "gns_trace": "loss/gns_trace",
    "gns_low": "loss/gns_low", "gns_high": "loss/gns_high",
    "gns_window_steps": "loss/gns_window_steps", "gns_trend_limited": "loss/gns_trend_limited",
    "skipped_steps": "loss/skipped_steps",  # health: steps not applied (non-finite)
    "skipped_batches": "loss/skipped_batches",  # health: batches a rollback left out
    "rolled_back_from_step": "loss/rolled_back_from_step",  # the mark of a rollback
    "aux": "aux",  # a user's loss_fn aux values: one scalar per path, aux/<path>
    "step_time_s": "perf/step_time_s", "tokens_per_s": "perf/tokens_per_s",
    "padded_tokens_per_s": "perf/padded_tokens_per_s", "mfu": "perf/mfu", "hfu": "perf/hfu",
    "data_wait_s": "perf/data_wait_s", "data_wait_fraction": "perf/data_wait_fraction",
    "goodput": "perf/goodput", "badput_s": "perf/badput_s",  # one scalar per category
    "memory_live_bytes": "memory/live_bytes",
    **{f"moe_{name}": f"moe/{name}" for name in (  # with experts
        "load_max_over_mean", "dropped_tokens", "load_balance_loss", "z_loss")},
}
# Facts of the compiled step: constant while it runs, so a scalar only when the value changes
# (the first record, and after a resume or rollback onto another layout), not a flat line.
PER_LAYOUT = {
    **{f"memory_{k}_bytes": f"memory/{k}_bytes"
       for k in ("peak", "argument", "output", "alias", "temp", "generated_code", "xla_peak")},
    "comm_bytes_per_step": "comm/bytes_per_step", "comm_bus_bytes_per_step": "comm/bus_bytes_per_step",
    "comm_bytes_by_kind": "comm/bytes_by_kind", "comm_bytes_by_axis": "comm/bytes_by_axis",
}
# Constants of the run or of a session: in the `facts` text (on change), never scalars.
AS_TEXT = ("n_devices", "peak_flops_per_device", "peak_flops_source", "model_flops_per_step",
           "flops_convention", "hardware_flops_per_step", "xla_flops_per_step", "batch_tokens",
           "gns_source", "compile_time_s", "resumed_from_step", "resumed_from_mesh")
# Bookkeeping and wall time: not logged (the step is TensorBoard's own axis).
NOT_LOGGED = ("schema", "step", "steps_in_interval", "time", "elapsed_s", "checkpoint_saved")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scalars(tag: str, value) -> dict[str, float]:
    """A number (or flag) as one scalar; a {name: number} map as one per name (`tag/name`)."""
    if isinstance(value, dict):
        return {f"{tag}/{k}": v for k, v in value.items() if _number(v)}
    if isinstance(value, bool):  # a flag plots as 0/1
        return {tag: float(value)}
    return {tag: value} if _number(value) else {}


class TaggedScalars:
    """A record's numbers under the tags above, the same for every tracking sink: the
    PER_RECORD fields (and any numeric field no group names, under `other/`) at every record;
    the PER_LAYOUT scalars and the facts (PER_LAYOUT and AS_TEXT values) when they change."""

    def __init__(self):
        self._layout: dict[str, Any] = {}  # the PER_LAYOUT and AS_TEXT values last seen

    def __call__(self, record: dict) -> tuple[dict[str, float], dict[str, Any] | None]:
        """(scalars by tag, the facts where they changed since the last record, else None)."""
        scalars: dict[str, float] = {}
        facts: dict[str, Any] | None = {
            k: record[k] for k in (*PER_LAYOUT, *AS_TEXT) if k in record}
        if facts != {k: self._layout.get(k) for k in facts}:
            for key in PER_LAYOUT:
                scalars.update(_scalars(PER_LAYOUT[key], record.get(key)))
            self._layout.update(facts)
        else:
            facts = None
        for key, value in record.items():
            if key in PER_RECORD:
                scalars.update(_scalars(PER_RECORD[key], value))
            elif key not in (*PER_LAYOUT, *AS_TEXT, *NOT_LOGGED):
                scalars.update(_scalars(f"other/{key}", value))
        return scalars, facts


class TensorBoardSink:
    """Records as grouped scalars (`loss/`, `perf/`, `memory/`, `comm/`; fields no group names
    under `other/`), the spec once as text, the step's constant facts as text."""

    def __init__(self, logdir: Path, spec=None):
        writer = _summary_writer_class()
        if writer is None:
            raise UserInputError(
                "metrics.tensorboard: no TensorBoard writer installed "
                "(pip install 'trainspec[tensorboard]')")
        self._writer = writer(str(logdir))
        self._spec = spec
        self._tagged = TaggedScalars()

    def write(self, record: dict) -> None:
        step = record["step"]
        if self._spec is not None:
            text = json.dumps(self._spec.to_dict(), indent=2)
            self._writer.add_text("spec", "```\n" + text + "\n```", step)
            self._spec = None
        scalars, facts = self._tagged(record)
        if facts is not None:
            self._writer.add_text("facts", "\n".join(
                f"- {k}: `{v}`" for k, v in sorted(facts.items())), step)
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)

    def rewind(self, step: int) -> dict[int, float]:
        return {}  # event files are append-only; viewers show the redone steps' newer values

    def close(self) -> None:
        self._writer.close()


def sinks_for(spec, run_dir: Path, writer: bool, append: bool = False) -> list[Sink]:
    """The spec's sinks under `run_dir` on the `writer` process (process 0, one per job: every
    process computes the records); none elsewhere. `append`: keep the records there (a resume)."""
    if not writer:
        return []
    factories = [registered_sink(name) for name in spec.metrics.sinks]  # all found, or none
    sinks: list[Sink] = [JsonlWriter(run_dir / spec.metrics.path, append)]
    if spec.metrics.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard", spec))
    return sinks + [make(spec, Path(run_dir), append) for make in factories]


ENTRY_POINTS = "trainspec.sinks"


def check_sinks(spec) -> None:
    """UserInputError naming metrics.sinks unless every sink it names is installed: said
    before a run writes anything (validate refuses it too)."""
    for name in spec.metrics.sinks:
        registered_sink(name)


def registered_sink(name: str):
    """The factory registered as `name` under the `trainspec.sinks` entry points (the package's
    own `wandb` and `mlflow`, and any an installed package adds): `make(spec, run_dir, append)
    -> Sink` (write, rewind, close; trainspec.core.recorder.Sink). Loading it imports the
    sink's module, so a sink whose library is missing is refused here, before any file."""
    found = declared(ENTRY_POINTS)
    if name not in found:
        raise UserInputError(f"metrics.sinks: no sink {name!r} is installed (registered under "
                             f"the {ENTRY_POINTS} entry points: {', '.join(sorted(found)) or 'none'})")
    module_name, _, attribute = found[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as missing:
        own = module_name.startswith("trainspec.")  # the package's own: its extra brings it
        package = missing.name.partition(".")[0]
        raise UserInputError(
            f"metrics.sinks: the sink {name!r} needs {package!r}, which is not installed"
            + (f" (pip install 'trainspec[{name}]')" if own else "")) from None
    return getattr(module, attribute)
