"""The implementation of trainspec on PyTorch: torch.distributed (gloo on CPU, NCCL on GPU),
FSDP2 `fully_shard` and DTensor tensor parallelism. It imports no jax; it builds on
trainspec.core, as trainspec.jax does (the interface: trainspec.core.adapter, docs/adapters.md).
"""
