"""A backend in NumPy, for testing the trunk's run loop (trainspec.core.run) in milliseconds:
an engine (trainspec.core.backend.Engine) of a linear model trained by SGD on a weighted mean
squared error, and a store that moves its bytes under the trunk's checkpoint policy
(trainspec.core.store: manifest, verification, quarantine, fallback). Everything it does not
decide (records, rollback, resume, checkpoint cadence) is the trunk's."""
from __future__ import annotations

import numpy as np

from trainspec.core import store
from trainspec.core.health import ReplicaMismatch

FEATURES, ROWS, LEARNING_RATE = 4, 8, 0.1
TRUE_WEIGHTS = np.arange(1.0, FEATURES + 1.0)
STATE_FILE = "state.npy"


def batch_at(index: int) -> dict:
    """Batch `index`: a pure function of it (the loop's data contract). `mask` weights each
    row (the trunk's fault injection sets it to NaN)."""
    rng = np.random.default_rng(index)
    inputs = rng.standard_normal((ROWS, FEATURES))
    return {"inputs": inputs, "targets": inputs @ TRUE_WEIGHTS, "mask": np.ones(ROWS)}


class NumpyEngine:
    framework = "numpy"
    gns_note = "the numpy backend does not measure it"
    is_writer, process_index, participants, local_signals = True, 0, ["process 0"], True
    eval_data = None

    def __init__(self, spec):
        self.spec, self.mesh_shape = spec, {"data": 1}

    def __call__(self, state, batch):
        error = (batch["inputs"] @ state - batch["targets"]) * batch["mask"]
        grad = 2 * batch["inputs"].T @ error / ROWS
        metrics = {"loss": float(np.mean(error ** 2)), "grad_norm": float(np.linalg.norm(grad)),
                   "valid_tokens": float(ROWS)}
        return state - LEARNING_RATE * grad, metrics

    def facts(self, state, batch) -> dict:
        """Nothing measured (null, as the record format prescribes) but the batch."""
        return {**dict.fromkeys((
            "model_flops_per_step", "flops_convention", "peak_flops_per_device",
            "peak_flops_source", "hardware_flops_per_step", "compile_time_s",
            "memory_peak_bytes", "comm_bytes_per_step", "comm_bus_bytes_per_step")),
            "n_devices": 1, "batch_tokens": ROWS, "comm_bytes_by_kind": {},
            "comm_bytes_by_axis": {}}

    def per_record(self) -> dict:
        return {}

    def to_host(self, tree):
        return tree

    def learning_rate(self, updates: int) -> float:
        return LEARNING_RATE

    def summary_fields(self) -> dict:
        return {}

    # the guard of the step: none (the trunk judges bad steps under `rollback`)
    def reset_guard(self, step: int, skipped: int, consecutive: int) -> None:
        pass

    def check_nonfinite(self) -> int:
        return 0

    def nonfinite_counts(self) -> dict:
        return {"skipped_steps": 0, "consecutive_nonfinite": 0}

    def verdict_inputs(self, metrics):
        return metrics

    def read_verdicts(self, inputs: list) -> list[tuple[bool, float]]:
        return [(bool(np.isfinite(m["grad_norm"])), m["loss"]) for m in inputs]

    def state_is_finite(self, state) -> bool:
        return bool(np.all(np.isfinite(state)))

    def check_replicas(self, state, step: int, last_good_step: int | None) -> None:
        if not np.all(np.isfinite(state)):  # one copy: nothing to vote on but itself
            raise ReplicaMismatch(f"state not finite after step {step}", last_good_step or 0, [0])

    def corrupt(self, state, target: int):
        flipped = state.copy()
        flipped.view(np.int64)[0] ^= 1 << 52
        return flipped

    def finish(self, state) -> None:
        pass

    def gather_times(self, local: np.ndarray) -> np.ndarray:
        return local[None]

    def stop_signal(self, step: int, received: int | None) -> int | None:
        return received


class NumpyStore:
    """The store: the state's bytes as one .npy file (read back without pickle) in the
    trunk's checkpoint layout."""

    def __init__(self, spec, run_dir):
        self.spec = spec
        self.checkpoints = store.Checkpoints(run_dir / spec.checkpoint.dir)
        self.directory, self.last_saved = self.checkpoints.directory, None

    @property
    def enabled(self) -> bool:
        return self.spec.checkpoint.interval > 0

    def due(self, step: int, last_step: int) -> bool:
        return store.due(step, last_step, self.spec.checkpoint.interval)

    def save(self, step: int, state, total_steps: int, health: dict) -> None:
        np.save(self.checkpoints.partial(step) / STATE_FILE, state, allow_pickle=False)
        self.checkpoints.seal(step, {"data_position": step, "total_steps": total_steps,
                                     "health": health}, self.spec.checkpoint.keep)
        self.last_saved = step

    def wait(self) -> None:
        pass

    def restore_latest(self, target):
        def restore(step: int):
            meta = self.checkpoints.verified(step)["meta"]
            state = np.load(self.directory / str(step) / STATE_FILE, allow_pickle=False)
            return state, meta

        found = self.checkpoints.restore_newest(restore)
        return (None, None) if found is None else found

    def saved_total_steps(self) -> int | None:
        steps = self.checkpoints.steps()
        return self.checkpoints.manifest(steps[0])["meta"]["total_steps"] if steps else None

    def set_aside(self):
        return self.checkpoints.set_aside()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
