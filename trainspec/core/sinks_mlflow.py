"""The `mlflow` sink (`metrics.sinks = ["mlflow"]`, the `mlflow` extra): every record's numbers
logged as MLflow metrics at the record's step under TensorBoard's tags
(trainspec.core.sinks.TaggedScalars), the spec as the artifact spec.json, the step's facts as
tags. To MLFLOW_TRACKING_URI (a server or a database) where it is set, else to a file store at
RUN_DIR/mlruns (`mlflow ui --backend-store-uri RUN_DIR/mlruns` shows it): the one store that
mlflow-skinny writes without a server or SQLAlchemy, which MLflow 3 accepts only under
MLFLOW_ALLOW_FILE_STORE, so the sink sets that for its own default store.

Importing this module imports mlflow, so naming the sink without the package is refused when
the spec is checked, before the run writes anything (trainspec.core.sinks.registered_sink).
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from mlflow.entities import Metric, RunStatus
from mlflow.tracking import MlflowClient

from trainspec.core.sinks import TaggedScalars

# The run's id, kept so that a resume (append) continues the same MLflow run.
RUN_ID_FILE = "mlflow_run_id"
BATCH = 1000  # metrics per log_batch call, MLflow's limit


def metric_key(tag: str) -> str:
    """The tag as an MLflow metric name: characters MLflow refuses (outside letters, digits,
    `_-. /:`) in a user's aux path become `_`."""
    return re.sub(r"[^\w\-. /:]", "_", tag)


class MlflowSink:
    def __init__(self, spec, run_dir: Path, append: bool):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        id_file = run_dir / RUN_ID_FILE
        if append and id_file.is_file():
            self._run_id = id_file.read_text().strip()
            self._client.update_run(self._run_id, RunStatus.to_string(RunStatus.RUNNING))
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "trainspec")
            experiment = self._client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment
                             else self._client.create_experiment(name))
            self._run_id = self._client.create_run(
                experiment_id, run_name=run_dir.resolve().name).info.run_id
            self._client.log_dict(self._run_id, spec.to_dict(), "spec.json")
            id_file.write_text(self._run_id)
        self._tagged = TaggedScalars()

    def write(self, record: dict) -> None:
        scalars, facts = self._tagged(record)
        if facts is not None:
            for key, value in facts.items():
                self._client.set_tag(self._run_id, f"facts.{key}", str(value))
        millis = int(record.get("time", time.time()) * 1000)
        metrics = [Metric(metric_key(tag), float(value), millis, record["step"])
                   for tag, value in scalars.items()]
        for start in range(0, len(metrics), BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[start:start + BATCH])

    def rewind(self, step: int) -> dict[int, float]:
        return {}  # a metric's history keeps every point; the redone steps are logged again

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def make(spec, run_dir: Path, append: bool) -> MlflowSink:
    return MlflowSink(spec, Path(run_dir), append)
