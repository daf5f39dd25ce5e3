"""The W&B and MLflow sinks (the `wandb` and `mlflow` extras) on a run of the trunk's loop
(NumPy backend, milliseconds a step): the offline W&B run directory and the MLflow file store
under the run dir hold every record's loss at its step, a resume continues the same W&B and
MLflow run, and a sink whose library is missing is one line naming metrics.sinks."""
import json
import struct
import sys

import numpy as np
import pytest

from numpy_backend import NumpyEngine, NumpyStore, batch_at
from trainspec.core.errors import UserInputError
from trainspec.core.loop import train
from trainspec.core.run import Run
from trainspec.core.sinks import check_sinks
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec


def _spec(sink):
    return load_spec(DEFAULT_SPEC_PATH, [f'metrics.sinks=["{sink}"]', "metrics.interval=1",
                                         "checkpoint.interval=3", "checkpoint.async_save=false",
                                         "health.fingerprints.interval=0", "eval.interval=0"])


def _train(spec, run_dir, steps):
    loop = Run(spec, run_dir, NumpyStore(spec, run_dir), steps, progress=False)
    train(loop, lambda run: (NumpyEngine(spec), None, lambda: np.zeros(4), batch_at))


def _jsonl_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())}


def _wandb_records(path):
    """The protobuf records of a W&B transaction log (run-ID.wandb): a 7-byte header, then
    LevelDB log blocks of 32 KiB holding (crc32c, length, type, data) chunks; type 1 is a whole
    record, 2/3/4 its first/middle/last parts."""
    from wandb.proto import wandb_internal_pb2

    data, block, out, parts = path.read_bytes(), 32768, [], b""
    assert data[:4] == b":W&B", path
    position = 7
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = struct.unpack_from("<HB", data, position + 4)
        if kind == 0:  # zero padding past the last record
            break
        parts += data[position + 7: position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def _wandb_losses(run_dir) -> dict[int, float]:
    """Every history row's `loss/loss` by its `step`, over the run's offline W&B runs."""
    losses = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in _wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                losses[row["step"]] = row["loss/loss"]
    return losses


def test_an_offline_wandb_run_holds_the_records_and_a_resume_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the sink's default: offline
    run_dir = tmp_path / "run"
    _train(_spec("wandb"), run_dir, 3)
    first_id = (run_dir / "wandb" / "trainspec_run_id").read_text()
    _train(_spec("wandb"), run_dir, 5)  # resumes from step 3's checkpoint
    # W&B's service writes the log after finish() returns: wait for it as a process's exit does
    import wandb
    wandb.teardown()
    logs = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert [p.name for p in logs] == [f"run-{first_id}.wandb"] * 2  # one W&B run, two sessions
    expected = _jsonl_losses(run_dir)
    assert sorted(expected) == [1, 2, 3, 4, 5]
    assert _wandb_losses(run_dir) == pytest.approx(expected, rel=1e-12)


def test_an_mlflow_file_store_holds_the_records_and_a_resume_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the sink's default store
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = tmp_path / "run"
    _train(_spec("mlflow"), run_dir, 3)
    _train(_spec("mlflow"), run_dir, 5)
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "trainspec"]
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == (run_dir / "mlflow_run_id").read_text()
    assert run.info.status == "FINISHED"
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss/loss")}
    assert logged == pytest.approx(_jsonl_losses(run_dir), rel=1e-12)
    spec = json.loads(client.download_artifacts(run.info.run_id, "spec.json", str(tmp_path)) and
                      (tmp_path / "spec.json").read_text())
    assert spec["metrics"]["sinks"] == ["mlflow"]


@pytest.mark.parametrize("sink, module", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_sink_whose_library_is_missing_is_one_line(sink, module, monkeypatch):
    for name in [module, *(m for m in sys.modules if m.startswith(f"{module}."))]:
        monkeypatch.setitem(sys.modules, name, None)  # imports fail as where it is not installed
    monkeypatch.delitem(sys.modules, f"trainspec.core.sinks_{sink}", raising=False)
    with pytest.raises(UserInputError) as err:
        check_sinks(_spec(sink))
    assert str(err.value) == (f"metrics.sinks: the sink {sink!r} needs {module!r}, which is "
                              f"not installed (pip install 'trainspec[{sink}]')")
