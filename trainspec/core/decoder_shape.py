"""A decoder-only transformer in numbers: parameters (total and active per token) and training
FLOPs per token, for the reference model and for published shapes (grouped-query or latent
attention, gated MLPs, mixtures of experts with shared experts and leading dense layers).

Active parameters are those a token passes through: every attention and norm parameter, the
router, the shared experts and `top_k` of the routed experts of each MoE layer. The model FLOPs
of a step count active parameters only (docs/metrics.md): an expert a token does not visit
does no work for it.
"""
from __future__ import annotations

import dataclasses

from trainspec.core.flops import CONVENTIONS


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    name: str
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int          # query/key width per head
    kv_heads: int
    d_ff: int              # the dense MLP's hidden width
    vocab: int
    gated_mlp: bool = False        # SwiGLU: three matrices instead of two
    tied_embeddings: bool = False
    v_head_dim: int | None = None  # value width per head, where it differs (latent attention)
    attention_params: int | None = None  # per layer, where the projections are not q, k, v, o
    experts: int = 0               # routed experts per MoE layer; 0 = dense
    top_k: int = 0
    shared_experts: int = 0
    expert_d_ff: int | None = None  # each expert's hidden width (default d_ff)
    dense_layers: int = 0          # leading layers with a dense MLP in a MoE model

    @property
    def moe_layers(self) -> int:
        return self.n_layers - self.dense_layers if self.experts else 0

    def mlp_params(self, width: int) -> int:
        return (3 if self.gated_mlp else 2) * self.d_model * width

    @property
    def attention_params_per_layer(self) -> int:
        if self.attention_params is not None:
            return self.attention_params
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * d * q + 2 * d * kv  # query and output; key and value

    @property
    def expert_params(self) -> int:
        """Every routed expert's parameters: what an expert axis splits."""
        return self.moe_layers * self.experts * self.mlp_params(self.expert_d_ff or self.d_ff)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.d_model

    def _params(self, routed_per_layer: int) -> int:
        d = self.d_model
        dense_mlps = (self.n_layers - self.moe_layers) * self.mlp_params(self.d_ff)
        expert = self.mlp_params(self.expert_d_ff or self.d_ff)
        moe = self.moe_layers * ((routed_per_layer + self.shared_experts) * expert
                                 + d * self.experts)  # the router
        norms = (2 * self.n_layers + 1) * d
        head = 0 if self.tied_embeddings else self.embedding_params
        return (self.n_layers * self.attention_params_per_layer + dense_mlps + moe + norms
                + self.embedding_params + head)

    @property
    def total_params(self) -> int:
        return self._params(self.experts)

    @property
    def active_params(self) -> int:
        return self._params(self.top_k)

    @property
    def non_expert_params(self) -> int:
        return self.total_params - self.expert_params

    def attention_flops_per_token(self, seq_len: int, convention: str) -> float:
        """Scores (Q K^T, width head_dim) and weighted values (A V, width v_head_dim): 2
        FLOPs per multiply-add, x3 for forward and backward, per layer and head; halved
        under the causal discount. 12 L d T for plain multi-head attention."""
        widths = self.head_dim + (self.v_head_dim or self.head_dim)
        full = 6.0 * self.n_layers * self.n_heads * widths * seq_len
        return full / 2 if convention == "causal_discount" else full

    def model_flops_per_token(self, seq_len: int,
                              convention: str = "no_causal_discount") -> float:
        """6 x (active parameters less the input embedding table, a lookup) + attention."""
        if convention not in CONVENTIONS:
            raise ValueError(f"unknown FLOPs convention {convention!r}")
        return (6.0 * (self.active_params - self.embedding_params)
                + self.attention_flops_per_token(seq_len, convention))


def reference_shape(model) -> DecoderShape:
    """The reference transformer of a `ModelSpec` (trainspec.jax.models.transformer):
    multi-head attention, a two-matrix GELU MLP, an untied head; with `moe`, every block's
    MLP is `experts` MLPs of width d_ff."""
    moe = model.moe
    return DecoderShape(
        "reference", model.d_model, model.n_layers, model.n_heads,
        model.d_model // model.n_heads, model.n_heads, model.d_ff, model.vocab_size,
        experts=moe.experts if moe else 0, top_k=moe.top_k if moe else 0)
