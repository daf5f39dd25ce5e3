"""The implementation of trainspec on PyTorch: torch.distributed (gloo on CPU, NCCL on GPU),
FSDP2 `fully_shard` and DTensor tensor parallelism. It imports no jax; it builds on
trainspec.core, as trainspec.jax does (the interface: trainspec.core.adapter, docs/adapters.md).

The public entry points: `wrap` (the spec's train step around your own nn.Module),
`WrappedStep`, `TorchCheckpointer`. They are imported on first use, so that the modules that
decide without torch (support) do not load it.
"""
import importlib

_ENTRY_POINTS = {
    "wrap": "trainspec.torch.wrapped",
    "WrappedStep": "trainspec.torch.wrapped",
    "TorchCheckpointer": "trainspec.torch.checkpoint",
}

__all__ = list(_ENTRY_POINTS)


def __getattr__(name: str):
    if name not in _ENTRY_POINTS:
        raise AttributeError(f"module 'trainspec.torch' has no attribute {name!r}")
    return getattr(importlib.import_module(_ENTRY_POINTS[name]), name)


def __dir__():
    return sorted(__all__)
