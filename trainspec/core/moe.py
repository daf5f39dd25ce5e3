"""Mixture-of-experts routing in NumPy: the decisions every implementation takes from here
(docs/spec.md, `[model.moe]`), and the float64 reference of a MoE layer.

A router's logits (tokens, experts) give each token its `top_k` experts (highest probability
first, ties to the lower index) and gates (the softmax probabilities of the chosen experts,
renormalised to sum to 1). An expert takes at most `capacity` (token, expert) assignments; the
rest are dropped in a fixed order: all first choices are placed before any second choice, and
within one choice rank the earlier token first (GShard/Switch's priority). The placement is
two index maps: `dispatch[e, c]` the token in slot c of expert e (-1 = empty), and
`slot[t, j]` the slot of token t's j-th choice (-1 = dropped); an expert-parallel run sends
exactly the dispatched rows to each expert's device and back (the two all-to-alls).

The auxiliary losses are per layer: Switch's load balance experts * sum_e f_e * P_e, f_e the
fraction of assignments that chose expert e (before drops), P_e its mean router probability
(1 when perfectly balanced), and ST-MoE's z-loss mean_t logsumexp(logits_t)^2.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(capacity_factor * tokens * top_k / experts), or `tokens` when
    dropless (capacity_factor 0: a token takes an expert at most once)."""
    if capacity_factor == 0:
        return tokens
    return min(tokens, math.ceil(capacity_factor * tokens * top_k / experts))


@dataclasses.dataclass(frozen=True)
class Routing:
    experts: np.ndarray   # int[tokens, top_k]: chosen experts, best first
    gates: np.ndarray     # float[tokens, top_k]: their renormalised probabilities
    slot: np.ndarray      # int[tokens, top_k]: slot in the expert's buffer, -1 = dropped
    dispatch: np.ndarray  # int[experts, capacity]: token in each slot, -1 = empty
    load: np.ndarray      # int[experts]: assignments each expert was chosen for (before drops)
    probs: np.ndarray     # float[tokens, experts]: the router's softmax

    @property
    def dropped(self) -> int:
        return int((self.slot < 0).sum())

    @property
    def load_max_over_mean(self) -> float:
        """Tokens per expert, the busiest over the mean (1 = perfectly balanced)."""
        return float(self.load.max() / self.load.mean())


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def logsumexp(logits: np.ndarray) -> np.ndarray:
    m = logits.max(-1)
    return m + np.log(np.exp(logits - m[..., None]).sum(-1))


def route(logits: np.ndarray, top_k: int, capacity_factor: float) -> Routing:
    """The routing of `logits` (tokens, experts)."""
    tokens, n_experts = logits.shape
    probs = softmax(np.asarray(logits, np.float64))
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    picked = np.take_along_axis(probs, chosen, -1)
    gates = picked / picked.sum(-1, keepdims=True)
    slots = capacity(tokens, n_experts, top_k, capacity_factor)
    slot = np.full((tokens, top_k), -1)
    dispatch = np.full((n_experts, slots), -1)
    filled = np.zeros(n_experts, int)
    for j in range(top_k):              # every first choice before any second choice ...
        for t in range(tokens):         # ... and the earlier token first
            e = chosen[t, j]
            if filled[e] < slots:
                slot[t, j], dispatch[e, filled[e]] = filled[e], t
            filled[e] += 1
    load = np.bincount(chosen.reshape(-1), minlength=n_experts)
    return Routing(chosen, gates, slot, dispatch, load, probs)


def load_balance_loss(routing: Routing) -> float:
    """Switch Transformer's auxiliary loss: experts * sum_e f_e * P_e."""
    n_experts = routing.probs.shape[1]
    fraction = routing.load / routing.load.sum()
    return float(n_experts * np.sum(fraction * routing.probs.mean(0)))


def z_loss(logits: np.ndarray) -> float:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2."""
    return float(np.mean(logsumexp(np.asarray(logits, np.float64)) ** 2))


def combine(expert_out: np.ndarray, routing: Routing) -> np.ndarray:
    """Each token's output: the gate-weighted sum of its kept experts' outputs for it.
    expert_out: (experts, capacity, width), row c of expert e the output for dispatch[e, c]."""
    tokens, top_k = routing.slot.shape
    out = np.zeros((tokens, expert_out.shape[-1]))
    for j in range(top_k):
        kept = routing.slot[:, j] >= 0
        rows = expert_out[routing.experts[kept, j], routing.slot[kept, j]]
        out[kept] += routing.gates[kept, j, None] * rows
    return out


def moe_layer(x: np.ndarray, router: np.ndarray, expert_fn, top_k: int,
              capacity_factor: float) -> tuple[np.ndarray, Routing]:
    """A MoE layer on tokens x (tokens, width): route, dispatch each expert its rows (zeros in
    empty slots), apply `expert_fn(e, rows)`, combine. Returns the output and the routing."""
    logits = x @ router
    routing = route(logits, top_k, capacity_factor)
    gathered = np.where(routing.dispatch[..., None] >= 0, x[routing.dispatch], 0.0)
    expert_out = np.stack([expert_fn(e, gathered[e]) for e in range(router.shape[1])])
    return combine(expert_out, routing), routing
