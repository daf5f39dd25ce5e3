"""The implementation of trainspec on PyTorch: torch.distributed (gloo on CPU, NCCL on GPU),
FSDP2 `fully_shard` and DTensor tensor parallelism. It imports no jax; it builds on
trainspec.core, as trainspec.jax does (the interface: trainspec.core.adapter, docs/adapters.md).

The public entry points: `wrap` (the spec's train step around your own nn.Module),
`WrappedStep`, `PipelineIO` (what a pipeline takes of a wrapped model's batch and
loss), `TorchCheckpointer`, and `Run` (the run services of `trainspec train` for your
own loop). They are imported on first use, so that the modules that decide without torch
(support) do not load it.
"""
from trainspec.core.entry_points import on_first_use

_ENTRY_POINTS = {
    "wrap": "trainspec.torch.step",
    "WrappedStep": "trainspec.torch.step",
    "PipelineIO": "trainspec.torch.pipeline",
    "TorchCheckpointer": "trainspec.torch.checkpoint",
    "Run": "trainspec.torch.run",
}

__all__ = list(_ENTRY_POINTS)
__getattr__, __dir__ = on_first_use(__name__, _ENTRY_POINTS, __all__)
