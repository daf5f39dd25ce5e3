"""The trained parameters of a JAX run of the reference model: its newest good checkpoint,
restored onto this process's devices (orbax reshards it), as NumPy arrays by flax path
(`trainspec export`, trainspec/core/export.py)."""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from trainspec.core.reference_train import leaves
from trainspec.core.spec import Spec
from trainspec.jax import layout
from trainspec.jax.checkpoint import Checkpointer
from trainspec.jax.pipeline_params import whole_arrays
from trainspec.jax.train import build_job


def trained_params(spec: Spec, run_dir: Path) -> tuple[dict[str, np.ndarray], int] | None:
    """(parameters by flax path, the step they were saved at); None where no checkpoint is."""
    job = build_job(spec, init=False)
    with Checkpointer(spec, Path(run_dir)) as checkpoints:
        state, meta = checkpoints.restore_latest(job.abstract_state)
    if meta is None:
        return None
    params = whole_arrays(layout.strip_boxes(state.params))  # one leaf per block
    params = jax.tree.map(np.asarray, jax.device_get(params))
    return leaves(params), meta["step"]
