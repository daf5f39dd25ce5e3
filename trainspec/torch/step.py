"""The reference job's train step in PyTorch: the reference Transformer (trainspec/torch/model.py)
through the same wrapped step as a user's model (trainspec/torch/wrapped.py).

Its FSDP2 units are the blocks; its tensor-parallel plan is the default one (query/key/value and
mlp_in column-split, out and mlp_out row-split, the vocabulary head column-split with its output
gathered; the embedding table stays replicated). The model casts its matmul operands to
`precision.compute` itself, so no autocast.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from trainspec.core.spec import Spec
from trainspec.torch.adapter import TORCH_DTYPES as DTYPES
from trainspec.torch.model import Transformer, flax_path, next_token_loss
from trainspec.torch.support import check_spec
from trainspec.torch.wrapped import WrappedStep


def reference_loss(model: Transformer, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return next_token_loss(model(batch["inputs"]), batch["targets"], batch["mask"])


class TorchStep(WrappedStep):
    """Model, optimizer and the step of one rank. `__call__(rows)` takes this rank's rows of the
    global batch (`rows()` says which) and returns the step's global metrics; `apply(finite)`
    decides whether the update is taken (default: when finite)."""

    def __init__(self, spec: Spec, mesh: DeviceMesh, total_steps: int, device: torch.device,
                 initial_params: dict | None = None):
        check_spec(spec, mesh.size())
        p = spec.precision

        def build() -> Transformer:
            model = Transformer(spec.model, DTYPES[p.compute], DTYPES[p.param])
            if initial_params is None:
                model.init_weights(spec.seed)
            else:  # e.g. a JAX run's initial parameters, through NumPy (model.from_flax)
                model.load_state_dict(initial_params)
            return model

        # With a tensor axis too, the root's output is the head's DTensor.to_local(), a view,
        # and FSDP2 warns (on every rank) that an in-place op on it would skip its backward
        # hook. The loss reads the logits out of place only, so the warning says nothing here.
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r"FSDP2-wrapped module \(FSDPTransformer\) returned a view")
        super().__init__(build, reference_loss, spec, mesh=mesh, device=device,
                         total_steps=total_steps, fsdp_units=("blocks.*",), autocast=False,
                         nan_guard=False)

    @staticmethod
    def packing_order(named: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The data all-reduce's buffer in the JAX step's order: parameters by their flax path
        (sorted, as jax flattens the tree), kernels in the flax layout (in, out), i.e. the
        nn.Linear weights transposed. A compressed reduction then cuts the same int8 blocks
        and chunks as JAX's when the local blocks are whole parameters (the data layout)."""
        ordered = sorted(named, key=lambda pair: flax_path(pair[0]))
        return [block.t() if name.endswith("weight") else block for name, block in ordered]

    def __call__(self, rows: dict[str, np.ndarray],
                 apply: Callable[[bool], bool] = bool) -> dict[str, float]:
        return super().__call__(rows, apply=apply)
