"""The reference transformer (trainspec.jax.models.transformer) in numbers: its parameters with their
logical axes, and the activations one token leaves for the backward pass.

The planner needs these for a model of any size without building it, so they are written out
here from the model's definition; tests/core/test_plan.py checks the parameter table against the
flax model's own (shapes and logical names).
"""
from __future__ import annotations

import dataclasses

from trainspec.core.spec import MAX_WIDTH, ModelSpec


@dataclasses.dataclass(frozen=True)
class Param:
    path: str
    shape: tuple[int, ...]
    logical: tuple[str, ...]
    # Who gathers it when fsdp splits it: the model its kernels and the embedding, explicitly
    # (trainspec.jax.layout.gathered_for_use); XLA the norm scales, at each use (plan.comm).
    gathered_by_xla: bool = False

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def in_block(self) -> bool:
        """Part of a transformer block (what remat recomputes)."""
        return self.path.startswith("block_")

    @property
    def layer(self) -> int | None:
        """The block's index; None outside the blocks."""
        return int(self.path.split("/")[0].removeprefix("block_")) if self.in_block else None


def parameters(m: ModelSpec) -> list[Param]:
    d, h, f, v = m.d_model, m.n_heads, m.d_ff, m.vocab_size
    dh = d // h
    params = [Param("embedding", (v, d), ("vocab", "embed"))]
    for i in range(m.n_layers):
        b = f"block_{i}"
        params += [
            Param(f"{b}/attn_norm/scale", (d,), ("embed",), gathered_by_xla=True),
            *(Param(f"{b}/{n}/kernel", (d, h, dh), ("embed", "heads", "kv"))
              for n in ("query", "key", "value")),
            Param(f"{b}/out/kernel", (h, dh, d), ("heads", "kv", "embed")),
            Param(f"{b}/mlp_norm/scale", (d,), ("embed",), gathered_by_xla=True),
            *(_moe(b, m) if m.moe is not None else (
                Param(f"{b}/mlp_in/kernel", (d, f), ("embed", "mlp")),
                Param(f"{b}/mlp_out/kernel", (f, d), ("mlp", "embed")))),
        ]
    params += [Param("final_norm/scale", (d,), ("embed",), gathered_by_xla=True),
               Param("head/kernel", (d, v), ("embed", "vocab"))]
    return params


def _moe(b: str, m: ModelSpec) -> tuple[Param, ...]:
    """A mixture-of-experts MLP (trainspec.jax.models.moe): the router, replicated, and every
    expert's two kernels stacked along an `expert` dimension, which the expert axes split."""
    e, d, f = m.moe.experts, m.d_model, m.d_ff
    return (Param(f"{b}/moe/router", (d, e), ("embed", None)),
            Param(f"{b}/moe/mlp_in", (e, d, f), ("expert", "embed", "mlp")),
            Param(f"{b}/moe/mlp_out", (e, f, d), ("expert", "mlp", "embed")))


@dataclasses.dataclass(frozen=True)
class TokenActivations:
    """Elements one token position keeps for the backward pass: `replicated` are not split
    by the tensor axis (residual stream, norms, the one-hot input), `split` are (heads, d_ff
    and vocabulary dimensions)."""

    replicated: float
    split: float


def token_activations(m: ModelSpec, seq_len: int, remat: str, fused_attention: bool = False,
                      layers: int | None = None, first: bool = True,
                      last: bool = True) -> TokenActivations:
    """Per layer, without remat: the block input, attention-norm output, residual after
    attention and MLP-norm output (4 d, replicated); q, k, v and the attention output (4 d),
    scores and probabilities (2 H T), the MLP input projection and its GELU (2 d_ff), split.
    Outside the layers: the one-hot input, logits and log-softmax (3 V, split: the one-hot
    matmul with the vocabulary-split embedding is split like it, as XLA:CPU's compiled steps
    keep 3 V / tensor per token: plan.xla_cpu).
    A pipeline stage keeps its own `layers`, the input only if `first`, the logits if `last`.

    With `fused_attention` (flash attention: cuDNN on GPUs, Pallas on TPUs) the scores are
    never stored: one log-sum-exp per head and token is kept instead of 2 H T.

    `full` remat keeps only each block's input (d); the dots policies keep the matmul outputs
    (q, k, v, attention output, MLP projections) and recompute the rest; with
    `dots_with_no_batch_dims_saveable` the attention einsums (batch dims) are recomputed too.
    """
    d, h, f = m.d_model, m.n_heads, m.d_ff
    L = m.n_layers if layers is None else layers
    scores = h if fused_attention else 2 * h * seq_len
    replicated, split = {
        "full": (d, 0),
        "dots_saveable": (d, 4 * d + scores / 2 + f),
        "dots_with_no_batch_dims_saveable": (d, 4 * d + f),
    }.get(remat, (4 * d, 4 * d + scores + 2 * f))
    return TokenActivations(L * replicated, L * split + (first + 2 * last) * m.vocab_size)


# --params: the shape of a transformer of a given size. GPT-3 175B's shape (96 layers of width
# 12288: 128 per layer) with heads of width 128 (GPT-3 175B, Llama) and d_ff = 4 d_model;
# Kaplan et al. 2020 (sec. 3.1) found the loss nearly flat in the aspect ratio over a wide range
# around it, so one ratio serves every size.
WIDTH_PER_LAYER = 128
HEAD_WIDTH = 128
FF_RATIO = 4
MAX_LAYERS = MAX_WIDTH // (FF_RATIO * WIDTH_PER_LAYER)  # d_ff within the schema's width bound


def _nearest(n_params: float, count, low: int, high: int) -> int:
    """The x in [low, high] whose count(x) is nearest n_params, count increasing."""
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if count(mid) <= n_params else (low, mid)
    return min((low, high), key=lambda x: abs(count(x) - n_params))


def shape_for_params(n_params: float, base: ModelSpec) -> ModelSpec:
    """A model of about `n_params` parameters with `base`'s vocabulary: n_layers = L nearest
    the rule d_model = 128 L, then d_model the multiple of 128 nearest the count at that L
    (the ratio moves a little so that the count lands within a few percent, not within a
    factor (L+1)^3 / L^3), n_heads = d_model / 128, d_ff = 4 d_model.
    Raises ValueError outside the sizes the rule can build."""
    def shaped(layers: int, width: int) -> ModelSpec:
        d = HEAD_WIDTH * width
        return base.model_copy(update={"n_layers": layers, "d_model": d, "n_heads": width,
                                       "d_ff": FF_RATIO * d})

    def count(model: ModelSpec) -> int:
        return sum(p.size for p in parameters(model))

    smallest, largest = count(shaped(1, 1)), count(shaped(MAX_LAYERS, MAX_LAYERS))
    if not smallest / 2 <= n_params <= largest:
        raise ValueError(f"{n_params:.3g} is outside the sizes the shape rule builds: "
                         f"{smallest / 2:.3g} (1 layer of width {HEAD_WIDTH}) to {largest:.3g}")
    layers = _nearest(n_params, lambda n: count(shaped(n, n)), 1, MAX_LAYERS)
    width = _nearest(n_params, lambda w: count(shaped(layers, w)), 1, MAX_LAYERS)
    return shaped(layers, width)
