"""The trunk's run loop (trainspec.core.run, trainspec.core.loop.train) driven on a NumPy backend
(numpy_backend.py), in milliseconds: records, resume, a rollback past a NaN batch, and a damaged
checkpoint quarantined with the resume falling back to the previous good one."""
import json

import numpy as np
import pytest

from numpy_backend import NumpyEngine, NumpyStore, batch_at
from trainspec.core.faults import Faults
from trainspec.core.loop import train
from trainspec.core.run import Run
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec


def _spec(*overrides):
    return load_spec(DEFAULT_SPEC_PATH, ["checkpoint.interval=2", "checkpoint.async_save=false",
                                         "metrics.interval=1", "health.fingerprints.interval=0", "eval.interval=0",
                                         *overrides])


def _train(spec, run_dir, steps, faults=None):
    """(summary, the state the run ended with) of a run to `steps` in `run_dir`."""
    loop = Run(spec, run_dir, NumpyStore(spec, run_dir), steps, progress=False, faults=faults)
    summary = train(loop, lambda run: (NumpyEngine(spec), None, lambda: np.zeros(4), batch_at))
    return summary, loop.state


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_records_and_a_resume_equal_one_run(tmp_path):
    spec = _spec()
    whole, whole_state = _train(spec, tmp_path / "whole", 8)
    assert [r["step"] for r in _records(tmp_path / "whole")] == list(range(1, 9))
    assert all(r["framework"] == "numpy" for r in _records(tmp_path / "whole"))
    _train(spec, tmp_path / "split", 4)
    resumed, resumed_state = _train(spec, tmp_path / "split", 8)
    assert resumed["resumed_from"] == 4
    np.testing.assert_array_equal(resumed_state, whole_state)  # bitwise: same batches, same math
    assert [r["step"] for r in _records(tmp_path / "split")] == list(range(1, 9))


def test_a_nan_batch_rolls_back_and_is_skipped(tmp_path):
    spec = _spec("health.nan.policy=rollback")
    summary, state = _train(spec, tmp_path, 8, Faults(nan_steps=frozenset({5})))
    assert len(summary["rollbacks"]) == 1
    assert summary["rollbacks"][0]["bad_step"] == 5
    assert 4 in summary["skipped_batches"]  # data index 4 is step 5's batch
    assert np.all(np.isfinite(state))
    assert all(np.isfinite(r["loss"]) for r in _records(tmp_path) if r["step"] > 5)


def test_a_damaged_checkpoint_is_quarantined_and_the_previous_one_resumed(tmp_path):
    spec = _spec()
    _train(spec, tmp_path, 6)
    newest = tmp_path / "checkpoints" / "6" / "state.npy"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0x01  # one bit of the state
    newest.write_bytes(bytes(data))
    summary, _ = _train(spec, tmp_path, 8)
    assert summary["resumed_from"] == 4
    assert (tmp_path / "checkpoints-quarantine" / "6" / "state.npy").is_file()


def test_a_run_already_there_changes_nothing(tmp_path):
    from trainspec.core.run_files import AlreadyTrained

    spec = _spec()
    _train(spec, tmp_path, 4)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(AlreadyTrained):
        _train(spec, tmp_path, 3)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
