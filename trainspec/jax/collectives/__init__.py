"""Collectives over named mesh axes with interchangeable backends (see api.py, docs/collectives.md)."""
from trainspec.jax.collectives.api import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    current_backend,
    get_backend,
    guarantee_level,
    permute,
    reduce_scatter,
    set_default_backend,
    use_backend,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "current_backend",
    "get_backend",
    "guarantee_level",
    "permute",
    "reduce_scatter",
    "set_default_backend",
    "use_backend",
]
