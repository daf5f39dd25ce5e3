"""The trained parameters of a torch run of the reference model: its newest good checkpoint (the
trunk's store verifies it first) read into a whole, unsharded Transformer in this one process,
whatever world size and layout wrote it (trainspec.torch.state_files takes each saved block's
overlap), as NumPy arrays by flax path (`trainspec export`, trainspec/core/export.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from trainspec.core.errors import UserInputError
from trainspec.core.reference_train import leaves
from trainspec.core.spec import Spec
from trainspec.core.store import BadCheckpoint, Checkpoints
from trainspec.torch import state_files
from trainspec.torch.checkpoint import FORMAT
from trainspec.torch.models.transformer import Transformer, to_flax


def trained_params(spec: Spec, run_dir: Path) -> tuple[dict[str, np.ndarray], int] | None:
    """(parameters by flax path, the step they were saved at); None where no checkpoint is."""
    model = Transformer(spec.model)  # float32 whatever the run trained in: the export's dtype
    store = Checkpoints(Path(run_dir) / spec.checkpoint.dir)
    target = {"model": dict(model.named_parameters())}

    def restore(step: int) -> dict:
        manifest = store.verified(step)  # nothing is read before it verified
        meta = manifest["meta"]
        if meta.get("format") != FORMAT:
            raise BadCheckpoint(f"its meta is not that of a {FORMAT} checkpoint")
        if meta.get("semi_sync_groups") is not None:
            raise UserInputError("export: semi_sync: the run's groups hold parameters of their "
                                 "own between outer steps; export reads one model")
        state_files.read(store.directory / str(step), list(manifest["files"]), target)
        return meta

    meta = store.restore_newest(restore)
    if meta is None:
        return None
    return leaves(to_flax(model, target["model"])), meta["step"]
