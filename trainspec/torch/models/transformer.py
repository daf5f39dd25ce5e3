"""The reference transformer (trainspec/jax/models/transformer.py) in PyTorch, same maths and layout.

Every parameter has the flax parameter's path as its name (`block_0/query/kernel` becomes the
module path `block_0.query`) and the same numbers: flax kernels `[in..., out...]` are stored as
nn.Linear weights `(out, in)`, i.e. the kernel flattened to 2-D and transposed. `from_flax`
and `to_flax` convert a NumPy parameter tree either way, so a JAX run's initial parameters
start a torch run (the cross-framework equality test).

Linear layers are nn.Linear so that DTensor's ColwiseParallel/RowwiseParallel plans apply to
them as they are; attention reads the number of local heads from the projection's output, so
the same forward runs with the heads split over a tensor-parallel group.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainspec.core.spec import ModelSpec
from trainspec.torch.context import causal_attention
from trainspec.torch.models.moe import FAN_IN, MoEMlp

RMS_EPSILON = 1e-6  # flax.linen.RMSNorm's default


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * scale, statistics in float32 (as flax does)."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        x32 = x.float()
        mul = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPSILON) * self.scale.float()
        return (x32 * mul).to(x.dtype)


class Projection(nn.Linear):
    """nn.Linear without bias that computes in `compute` dtype whatever the storage dtype is
    (the flax Projection casts its kernel and input the same way)."""

    def __init__(self, n_in: int, n_out: int, compute: torch.dtype, param: torch.dtype):
        super().__init__(n_in, n_out, bias=False, dtype=param)
        self.compute = compute

    def forward(self, x):
        return F.linear(x.to(self.compute), self.weight.to(self.compute))


class Block(nn.Module):
    """`attention`: causal attention of (batch, heads, length, head_dim) tensors by global
    position (trainspec.torch.context.ContextSplit.attention under a split context axis)."""

    def __init__(self, c: ModelSpec, compute: torch.dtype, param: torch.dtype,
                 attention: Callable = causal_attention):
        super().__init__()
        self.head_dim, self.attention = c.d_model // c.n_heads, attention
        d, f = c.d_model, c.d_ff
        self.attn_norm = RMSNorm(d, param)
        self.query, self.key, self.value = (Projection(d, d, compute, param) for _ in range(3))
        self.out = Projection(d, d, compute, param)
        self.mlp_norm = RMSNorm(d, param)
        if c.moe is not None:
            self.moe = MoEMlp(c, compute, param)
        else:
            self.mlp_in = Projection(d, f, compute, param)
            self.mlp_out = Projection(f, d, compute, param)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        # (b, t, heads * head_dim) -> (b, heads, t, head_dim); heads may be this rank's share
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for p in (self.query, self.key, self.value))
        attn = self.attention(q, k, v)
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, -1))
        if hasattr(self, "moe"):
            return x + self.moe(self.mlp_norm(x))
        h = self.mlp_in(self.mlp_norm(x))
        return x + self.mlp_out(F.gelu(h, approximate="tanh"))  # flax's nn.gelu is the tanh form


class Transformer(nn.Module):
    """Token ids (batch, length) -> float32 logits (batch, length, vocab)."""

    def __init__(self, c: ModelSpec, compute: torch.dtype = torch.float32,
                 param: torch.dtype = torch.float32, attention: Callable = causal_attention):
        super().__init__()
        self.config, self.compute = c, compute
        self.embedding = nn.Parameter(torch.empty(c.vocab_size, c.d_model, dtype=param))
        self.blocks = nn.ModuleDict(
            {f"block_{i}": Block(c, compute, param, attention) for i in range(c.n_layers)})
        self.final_norm = RMSNorm(c.d_model, param)
        self.head = Projection(c.d_model, c.vocab_size, compute, param)

    def forward(self, tokens):
        """Token ids -> logits; a pipeline stage's part (trainspec.torch.pipeline) lacks the
        embedding (it takes the previous stage's activations) or the head (it returns its
        last block's)."""
        # indexing the table = the flax one-hot matmul, exactly
        x = tokens if self.embedding is None else self.embedding.to(self.compute)[tokens]
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head(self.final_norm(x)).float()

    def keep_stage(self, layers: range, first: bool, last: bool) -> None:
        """Drop every part a pipeline stage holding blocks `layers` does not hold: the
        embedding unless `first`, the final norm and head unless `last`. The names of what
        stays are unchanged, so checkpoints and parameter files read the same."""
        for name in [n for n in self.blocks if int(n.removeprefix("block_")) not in layers]:
            del self.blocks[name]
        if not first:
            self.embedding = None
        if not last:
            self.final_norm = self.head = None

    def init_weights(self, seed: int) -> None:
        """The flax initialisers' distributions: kernels N(0, 1/fan_in), embedding N(0, 1),
        norm scales 1 (the same distributions, not the same numbers: those come from
        `from_flax`)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                leaf = name.rpartition(".")[2]
                if name.endswith("scale"):
                    p.fill_(1.0)
                else:  # nn.Linear weights (out, in); the experts' kernels in the flax layout
                    std = 1.0 if name == "embedding" else p.shape[FAN_IN.get(leaf, 1)] ** -0.5
                    p.copy_(torch.randn(p.shape, generator=gen) * std)


def next_token_loss(logits, targets, mask):
    """(sum of per-token cross-entropy over valid tokens, number of valid tokens)."""
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten().long(), reduction="none")
    mask = mask.flatten().float()
    return (per_token * mask).sum(), mask.sum()


# -- the flax <-> torch parameter correspondence ------------------------------------------------


def flax_path(name: str) -> tuple[str, ...]:
    """torch parameter name -> flax parameter path."""
    parts = [p for p in name.split(".") if p != "blocks"]
    if parts[-1] == "weight":
        parts[-1] = "kernel"
    return tuple(parts)


def _to_torch_layout(kernel: np.ndarray, weight_shape) -> np.ndarray:
    n_out = weight_shape[0]
    return kernel.reshape(-1, n_out).T


def from_flax(model: Transformer, flax_params) -> dict[str, torch.Tensor]:
    """A state dict for `model` holding the numbers of a flax parameter tree (nested dicts of
    arrays, e.g. `jax.device_get(state.params)`)."""
    state = {}
    for name, p in model.named_parameters():
        node = flax_params
        for part in flax_path(name):
            node = node[part]
        value = np.asarray(node)
        if name.endswith("weight"):
            value = _to_torch_layout(value, p.shape)
        state[name] = torch.from_numpy(np.array(value, copy=True)).to(p.dtype)
    return state


def to_flax(model: Transformer, state: dict[str, torch.Tensor]) -> dict:
    """The inverse of `from_flax`: a nested dict of NumPy arrays in the flax shapes."""
    c = model.config
    hd = c.d_model // c.n_heads
    shapes = {"query": (c.d_model, c.n_heads, hd), "key": (c.d_model, c.n_heads, hd),
              "value": (c.d_model, c.n_heads, hd), "out": (c.n_heads, hd, c.d_model)}
    tree: dict = {}
    for name, tensor in state.items():
        path = flax_path(name)
        value = tensor.detach().cpu().float().numpy()
        if name.endswith("weight"):
            value = value.T.reshape(shapes.get(path[-2], value.T.shape))
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree

