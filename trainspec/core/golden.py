"""The conformance suite's references, shipped with it: trainspec/core/golden.json.

For the conformance job (the default spec shrunk to seconds on a CPU, `SPEC`): its batches
(byte windows and ragged masks, so that the data does not depend on the Python release whose
standard library is the corpus), a digest of its initial parameters
(trainspec.core.reference_train.initial_params), and for each optimizer of `OPTIMIZERS` the
per-step loss, gradient norm (before clipping) and parameter digest of `STEPS` steps from
those parameters. The numbers come from the float64 NumPy reference
(trainspec/core/reference_model.py, reference_train.py) and are written once by

    python -m trainspec.core.golden [--new-batches]

(the batches, once recorded, are kept). tests/conformance/test_golden.py checks that the
reference still gives the shipped numbers.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from trainspec.core import reference_train as ref
from trainspec.core.data import ByteBatches
from trainspec.core.spec import DEFAULT_SPEC_PATH, Spec, load_spec

PATH = Path(__file__).with_name("golden.json")
STEPS = 3
# The conformance job: the first update has the full learning rate (no warm-up), gradients
# are clipped (their norm is about 5 at the start), ragged masks.
SPEC = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.n_heads=4",
        "batch.seq_len=16", "batch.global_batch=32", "metrics.interval=1",
        "optimizer.warmup_steps=0", f"train.steps={STEPS}", "checkpoint.interval=0",
        "eval.interval=0",
        "health.fingerprints.interval=0"]
# SGD's update is proportional to the clipped gradient, so it shows a wrong clip where Adam,
# invariant to a constant gradient scale, would not. The third job decays every parameter and
# warms up over 2 of its 3 updates (learning rates 0, lr/2, then the cosine from lr): a decay
# left out or confined to some parameters, or a warm-up one update early or late, moves a
# parameter by a tenth of its update or more from step 1 or 2 on.
OPTIMIZERS = {"adamw": [], "sgd": ["optimizer.name=sgd", "optimizer.learning_rate=0.1"],
              "adamw-decay-warmup": ["optimizer.weight_decay=0.1", "optimizer.warmup_steps=2"]}


def spec(optimizer: str = "adamw", overrides: list[str] = ()) -> Spec:
    return load_spec(DEFAULT_SPEC_PATH, [*SPEC, *OPTIMIZERS[optimizer], *overrides])


def ragged_batch(data: ByteBatches, step: int) -> dict[str, np.ndarray]:
    """Batch `step` with a ragged mask: each sequence keeps a random prefix of >= 2 tokens."""
    batch = data.batch(step)
    rng = np.random.default_rng([data.seed, step, 1])
    lengths = rng.integers(2, data.seq_len + 1, data.global_batch)
    batch["mask"] = (np.arange(data.seq_len) < lengths[:, None]).astype(np.float32)
    return batch


def _encode(batch: dict) -> dict:
    windows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    return {"windows": [bytes(row.astype(np.uint8)).hex() for row in windows],
            "lengths": batch["mask"].sum(1).astype(int).tolist()}


def _decode(encoded: dict) -> dict[str, np.ndarray]:
    windows = np.array([list(bytes.fromhex(row)) for row in encoded["windows"]], np.int32)
    length = windows.shape[1] - 1
    mask = np.arange(length) < np.array(encoded["lengths"])[:, None]
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:], "mask": mask.astype(np.float32)}


def trajectory(optimizer: str, params: dict, batches: list[dict]) -> list[dict]:
    """The float64 reference's steps: per step its loss, gradient norm and parameter digest."""
    trainer = ref.Trainer(spec(optimizer), params)
    steps = []
    for batch in batches:
        loss, norm = trainer.step(batch)
        steps.append({"loss": loss, "grad_norm": norm,
                      "digest": ref.digest(trainer.params, params)})
    return steps


def compute(batches: list[dict] | None = None) -> dict:
    """The references from the float64 reference, on `batches` (default: the conformance job's
    first STEPS batches from this Python's corpus)."""
    s = spec()
    if batches is None:
        data = ByteBatches(s.batch.seq_len, s.batch.global_batch, s.seed)
        batches = [ragged_batch(data, step) for step in range(STEPS)]
    params = ref.initial_params(s.model, s.seed)
    zeros = ref.tree_map(np.zeros_like, params)
    return {"spec": SPEC, "optimizers": OPTIMIZERS, "batches": [_encode(b) for b in batches],
            "initial_digest": ref.digest(params, zeros),
            "trajectories": {name: trajectory(name, params, batches) for name in OPTIMIZERS}}


class Golden:
    """The shipped references, read back: batches as arrays, the rest as written."""

    def __init__(self, raw: dict):
        self.raw = raw
        self.batches = [_decode(b) for b in raw["batches"]]
        self.initial_digest = raw["initial_digest"]
        self.trajectories = raw["trajectories"]


def load(path: Path = PATH) -> Golden:
    return Golden(json.loads(path.read_text()))


def main(argv: list[str]) -> int:
    """Write golden.json; the batches already shipped are kept unless --new-batches."""
    keep = PATH.exists() and "--new-batches" not in argv
    PATH.write_text(json.dumps(compute(load().batches if keep else None), indent=1) + "\n")
    print(f"wrote {PATH}" + (" (the shipped batches kept)" if keep else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
