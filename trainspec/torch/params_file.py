"""The framework-neutral parameter file (trainspec.core.params_file) on torch: the file's
parameters as the reference model's state dict, and a sharded model's parameters gathered
whole to write one."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainspec.core import params_file
from trainspec.core.spec import ModelSpec
from trainspec.core.reference_train import leaves
from trainspec.torch.models.transformer import Transformer, from_flax, to_flax


def state_dict(flat: dict[str, np.ndarray], model: ModelSpec) -> dict[str, torch.Tensor]:
    """The reference Transformer's state dict holding the file's parameters (by path)."""
    return from_flax(Transformer(model), params_file.unflatten(flat))


def whole_params(model: nn.Module, stage_group=None) -> dict[str, torch.Tensor]:
    """Every parameter whole, by its torch name: a collective over the ranks that shard it
    (every rank must call it). `stage_group`: the pipeline's, whose stages hold the other
    parameters (each rank then gets every stage's)."""
    # gathering a 2-D sharded parameter is two collectives; torch warns each time
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    whole = {name: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
             for name, p in model.named_parameters()}
    if stage_group is None:
        return whole
    stages: list = [None] * dist.get_world_size(stage_group)
    dist.all_gather_object(stages, whole, group=stage_group)
    return {name: t for stage in stages for name, t in stage.items()}


def save_initial(model: Transformer, run_dir: Path, spec_model: ModelSpec,
                 stage_group=None) -> None:
    """RUN_DIR/initial_params.safetensors from a (sharded, pipelined) reference model (rank 0
    writes)."""
    whole = leaves(to_flax(model, whole_params(model, stage_group)))
    if dist.get_rank() == 0:
        params_file.write(params_file.initial_params_path(run_dir), whole, spec_model)
