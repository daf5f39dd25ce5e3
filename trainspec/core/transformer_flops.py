"""Analytic FLOPs and parameter counts of the reference transformer (transformer.py).

Kept beside the model, as torchtitan keeps `get_nparams_and_flops` with each model: a change of
the architecture changes this formula in the same place. Framework-free (the torch port of the
model uses it too); the conventions are trainspec.core.flops's.
"""
from __future__ import annotations

import dataclasses

from trainspec.core.decoder_shape import reference_shape
from trainspec.core.flops import CONVENTIONS
from trainspec.core.spec import ModelSpec, Spec


@dataclasses.dataclass(frozen=True)
class TransformerFlops:
    """Analytic FLOPs of the reference decoder (trainspec.jax.models.transformer) per token.
    With `model.moe`, the parameters a token passes through: top_k experts' MLPs and the
    router (trainspec.core.decoder_shape)."""

    model: ModelSpec
    seq_len: int
    remat: str = "none"

    @property
    def embedding_params(self) -> int:
        return self.model.vocab_size * self.model.d_model

    @property
    def active_mlp_width(self) -> int:
        """Hidden units a token passes through: d_ff, or top_k experts' d_ff."""
        return self.model.d_ff * (self.model.moe.top_k if self.model.moe else 1)

    @property
    def executed_mlp_width(self) -> int:
        """Hidden units computed per token: d_ff, or every expert's d_ff (the reference MoE runs
        each expert on every row, zeros where it did not take the row: buffers indexed by token,
        trainspec.jax.models.moe and trainspec.torch.models.moe)."""
        return self.model.d_ff * (self.model.moe.experts if self.model.moe else 1)

    @property
    def router_params(self) -> int:
        return self.model.d_model * self.model.moe.experts if self.model.moe else 0

    @property
    def block_matmul_params(self) -> int:
        """Matmul parameters one token passes through in a block: q, k, v, out; mlp_in and
        mlp_out (of each expert it visits) and the router."""
        d = self.model.d_model
        return 4 * d * d + 2 * d * self.active_mlp_width + self.router_params

    @property
    def non_embedding_params(self) -> int:
        """Active parameters except the input embedding table: blocks, norms, output head."""
        return reference_shape(self.model).active_params - self.embedding_params

    @property
    def total_params(self) -> int:
        """Every parameter, every expert included."""
        return reference_shape(self.model).total_params

    def attention_per_token(self, convention: str) -> float:
        """Scores (Q K^T) and weighted values (A V): 2 matmuls of 2 d T FLOPs each, x3 for
        forward + backward, per layer; halved under the causal discount."""
        full = 12.0 * self.model.n_layers * self.model.d_model * self.seq_len
        return full / 2 if convention == "causal_discount" else full

    def model_per_token(self, convention: str = "no_causal_discount") -> float:
        if convention not in CONVENTIONS:
            raise ValueError(f"unknown FLOPs convention {convention!r}")
        return 6.0 * self.non_embedding_params + self.attention_per_token(convention)

    def hardware_per_token(self) -> float:
        """What this implementation executes in matmuls: the model FLOPs without discount
        (the masked attention computes every score), every expert's MLP on every row, minus the
        norm scales (elementwise), plus
        the one-hot embedding matmul (forward 2 V d, weight gradient 2 V d) and the forward
        recomputed by rematerialisation."""
        m = self.model
        executed = self.block_matmul_params + 2 * m.d_model * (
            self.executed_mlp_width - self.active_mlp_width)
        matmul_params = m.n_layers * executed + m.d_model * m.vocab_size
        flops = 6.0 * matmul_params + self.attention_per_token("no_causal_discount")
        flops += 4.0 * m.vocab_size * m.d_model
        return flops + self.remat_per_token()

    def remat_per_token(self) -> float:
        m = self.model
        attn_fwd = 4.0 * m.d_model * self.seq_len  # scores + weighted values, forward
        if self.remat == "full":
            # The backward needs every block activation except the MLP output, so jax recomputes
            # the forward up to mlp_in: q, k, v, out, mlp_in projections and attention.
            mlp_in = m.d_model * self.executed_mlp_width + self.router_params
            return m.n_layers * (2.0 * (4 * m.d_model**2 + mlp_in) + attn_fwd)
        if self.remat == "dots_with_no_batch_dims_saveable":
            return m.n_layers * attn_fwd  # attention einsums have batch dims: recomputed
        return 0.0  # none, dots_saveable: every matmul output is kept


def for_spec(spec: Spec) -> TransformerFlops:
    return TransformerFlops(spec.model, spec.batch.seq_len, spec.remat.policy)
