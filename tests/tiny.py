"""A tiny reference job shared by the checkpoint and health tests (seconds, not minutes)."""
from spec_jax.core.spec import DEFAULT_SPEC_PATH, load_spec

TINY = [
    "model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.n_heads=2",
    "batch.seq_len=16", "batch.global_batch=16", "batch.micro_batch=16",
    "metrics.interval=2", "optimizer.warmup_steps=2",
]


def tiny_spec(*overrides: str):
    return load_spec(DEFAULT_SPEC_PATH, [*TINY, *overrides])
