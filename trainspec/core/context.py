"""How a `context` axis splits a sequence (docs/spec.md, `[context]`): the index maps every
implementation uses, and which key/value blocks a query block can see under the causal mask.

Rank r of n holds `positions(seq_len, n, split)[r]`, the global token positions of its local
sequence in local order: with `zigzag` chunks r and 2n-1-r of 2n (so that every rank has the
same causal work: a late chunk sees many keys, an early one few), with `contiguous` chunk r of n.
`split` permutes a sequence into the ranks' local sequences concatenated in rank order, and
`unsplit` puts such a concatenation back in sequence order.
"""
from __future__ import annotations

import numpy as np


def positions(seq_len: int, n: int, split: str = "zigzag") -> np.ndarray:
    """int[n, seq_len // n]: the global positions each rank holds, in its local order."""
    chunks = 2 * n if split == "zigzag" else n
    if split not in ("zigzag", "contiguous"):
        raise ValueError(f"unknown context split {split!r}")
    if seq_len % chunks:
        raise ValueError(f"seq_len {seq_len} does not split into {chunks} equal chunks")
    blocks = np.arange(seq_len).reshape(chunks, seq_len // chunks)
    if split == "contiguous":
        return blocks
    return np.concatenate([blocks[:n], blocks[::-1][:n]], axis=1)


def split_order(seq_len: int, n: int, split: str = "zigzag") -> np.ndarray:
    """int[seq_len]: the sequence position at each place of the ranks' local sequences
    concatenated (x[..., split_order] is the split sequence)."""
    return positions(seq_len, n, split).reshape(-1)


def unsplit_order(seq_len: int, n: int, split: str = "zigzag") -> np.ndarray:
    """int[seq_len]: the inverse permutation of `split_order`."""
    return np.argsort(split_order(seq_len, n, split))


def causal_work(seq_len: int, n: int, split: str = "zigzag") -> np.ndarray:
    """int[n]: (query, key) pairs each rank's queries attend to under the causal mask: equal
    across ranks for `zigzag`, growing with the rank for `contiguous`."""
    return (positions(seq_len, n, split) + 1).sum(axis=1)
