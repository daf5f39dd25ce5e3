"""Ring attention in NumPy float64: the reference every context-parallel implementation is
checked against (docs/spec.md, `[context]`).

Each of n ranks holds the queries, keys and values of its part of the sequence
(trainspec.core.context.positions). In step s = 0 .. n-1, rank r holds the key/value block
that started on rank (r - s) mod n; it scores its queries against that block under the causal
mask by global position, and merges the block's partial softmax into its running one (online
softmax: a running maximum m, denominator l and unnormalised output o, rescaled by exp(m_old -
m_new) whenever the maximum grows). Between steps every rank sends its block to rank r + 1: one
permute around the ring. After n steps each rank has seen every block, and o / l is exact
attention over the whole sequence; log(l) + m is the log-sum-exp the backward pass needs.
"""
from __future__ import annotations

import numpy as np

from trainspec.core.context import positions, split_order, unsplit_order


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Plain causal attention over whole sequences: q, k, v (batch, length, heads, head_dim)."""
    scores = np.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
    length = q.shape[1]
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


def merge_block(state, q, k, v, q_pos, k_pos):
    """One step of the online softmax: (m, l, o) after also attending to block (k, v).

    m, l: (batch, heads, queries); o: (batch, queries, heads, head_dim). A query that sees no
    key of the block (all masked) leaves its state unchanged."""
    m, l, o = state
    scores = np.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
    visible = k_pos[None, :] <= q_pos[:, None]
    scores = np.where(visible, scores, -np.inf)
    m_new = np.maximum(m, scores.max(-1))
    finite = np.isfinite(m_new)
    safe = np.where(finite, m_new, 0.0)
    p = np.where(visible, np.exp(scores - safe[..., None]), 0.0)
    rescale = np.where(np.isfinite(m), np.exp(m - safe), 0.0)
    l_new = l * rescale + p.sum(-1)
    o_new = o * rescale.transpose(0, 2, 1)[..., None] + np.einsum("bhts,bshd->bthd", p, v)
    return m_new, l_new, o_new


def held_block(rank: int, step: int, n: int) -> int:
    """The rank whose key/value block rank `rank` of n holds at ring step `step`: its own at
    step 0, then each step the block its predecessor held."""
    return (rank - step) % n


def ring_attention_ranks(q_blocks, k_blocks, v_blocks, pos_blocks):
    """Ring attention over ranks' local blocks (lists indexed by rank, each (batch, local,
    heads, head_dim); pos_blocks[r] the global positions of rank r's tokens). Returns each
    rank's output and log-sum-exp (batch, heads, local)."""
    n = len(q_blocks)
    states = []
    for q in q_blocks:
        b, t, h, _ = q.shape
        states.append((np.full((b, h, t), -np.inf), np.zeros((b, h, t)), np.zeros_like(q)))
    for step in range(n):
        held = [held_block(r, step, n) for r in range(n)]
        states = [merge_block(states[r], q_blocks[r], k_blocks[held[r]], v_blocks[held[r]],
                              pos_blocks[r], pos_blocks[held[r]]) for r in range(n)]
    outputs, lse = [], []
    for m, l, o in states:
        outputs.append(o / l.transpose(0, 2, 1)[..., None])
        lse.append(np.log(l) + m)
    return outputs, lse


def ring_attention(q, k, v, n: int, split: str = "zigzag") -> np.ndarray:
    """Causal attention of whole sequences (batch, length, heads, head_dim), computed as n
    ranks of a context axis would: split, ring, unsplit."""
    length = q.shape[1]
    order = split_order(length, n, split)

    def per_rank(x):  # the split sequence, cut into the ranks' local sequences
        return list(np.split(x[:, order], n, axis=1))

    outs, _ = ring_attention_ranks(per_rank(q), per_rank(k), per_rank(v),
                                   list(positions(length, n, split)))
    return np.concatenate(outs, axis=1)[:, unsplit_order(length, n, split)]
