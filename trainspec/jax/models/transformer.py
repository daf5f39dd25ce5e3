"""The small decoder-only transformer of the default job and the notebooks (flax linen).

Every parameter and the main activations carry the conventional logical axis names (`embed`,
`mlp`, `heads`, `kv`, `vocab`, `batch`, `length`), so any spec layout applies without changes.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from trainspec.core.spec import ModelSpec
from trainspec.jax.layout import gathered_for_use
from trainspec.jax.models.moe import MoEMlp

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Projection(nn.Module):
    """x[..., in] @ kernel[in..., out...] with a logically named kernel of any rank.

    A hand-written einsum rather than nn.DenseGeneral: DenseGeneral initialises a flattened 2-D
    kernel, which loses the per-dimension logical names that the layout needs.
    """

    shape: tuple[int, ...]
    names: tuple[str, ...]
    n_in: int = 1
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        fan_in = int(np.prod(self.shape[: self.n_in]))
        init = nn.initializers.normal(stddev=fan_in**-0.5)
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(init, self.names), self.shape, self.param_dtype
        )
        x, kernel = x.astype(self.dtype), gathered_for_use(kernel, self.names).astype(self.dtype)
        return jnp.tensordot(x, kernel, axes=(tuple(range(-self.n_in, 0)), tuple(range(self.n_in))))


def causal_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    config: ModelSpec
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    # (batch, length, heads, head_dim) x3 -> the same: causal attention by global position
    # (trainspec.jax.context.attention_for gives the context-parallel one)
    attention: Callable = causal_attention

    @nn.compact
    def __call__(self, x):
        c = self.config
        head_dim = c.d_model // c.n_heads
        norm = lambda name: nn.RMSNorm(  # noqa: E731
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            name=name,
        )
        h = norm("attn_norm")(x)
        proj = functools.partial(Projection, dtype=self.dtype, param_dtype=self.param_dtype)
        qkv = [
            proj((c.d_model, c.n_heads, head_dim), ("embed", "heads", "kv"), name=n)(h)
            for n in ("query", "key", "value")
        ]
        q, k, v = (nn.with_logical_constraint(t, ("batch", "length", "heads", "kv")) for t in qkv)
        attn = self.attention(q, k, v)
        out = proj((c.n_heads, head_dim, c.d_model), ("heads", "kv", "embed"), n_in=2, name="out")(attn)
        x = nn.with_logical_constraint(x + out, ("batch", "length", "embed"))
        h = norm("mlp_norm")(x)
        if c.moe is not None:
            h = MoEMlp(c, self.dtype, self.param_dtype, name="moe")(h)
        else:
            h = proj((c.d_model, c.d_ff), ("embed", "mlp"), name="mlp_in")(h)
            h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
            h = proj((c.d_ff, c.d_model), ("mlp", "embed"), name="mlp_out")(h)
        return nn.with_logical_constraint(x + h, ("batch", "length", "embed"))


def block_class(remat: str) -> type[nn.Module]:
    """The block, rematerialised under the spec's policy."""
    return Block if remat == "none" else nn.remat(Block, policy=REMAT_POLICIES[remat])


def embed(tokens, table, vocab_size: int, dtype):
    """Token ids (batch, length) -> (batch, length, embed) through the embedding `table`.

    A one-hot matmul rather than a gather: with the table split over vocab and embed, XLA's
    partitioner turns a gather into a full rematerialisation; a matmul it splits cleanly."""
    one_hot = jax.nn.one_hot(tokens, vocab_size, dtype=dtype)
    table = gathered_for_use(table, ("vocab", "embed"))
    x = jnp.einsum("blv,ve->ble", one_hot, table.astype(dtype))
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


def final_norm(dtype, param_dtype, name: str | None = None) -> nn.Module:
    return nn.RMSNorm(dtype=dtype, param_dtype=param_dtype, name=name,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)))


def head(config: ModelSpec, dtype, param_dtype, name: str | None = None) -> nn.Module:
    return Projection((config.d_model, config.vocab_size), ("embed", "vocab"), dtype=dtype,
                      param_dtype=param_dtype, name=name)


def as_logits(x):
    return nn.with_logical_constraint(x.astype(jnp.float32), ("batch", "length", "vocab"))


class Transformer(nn.Module):
    """Token ids (batch, length) -> logits (batch, length, vocab)."""

    config: ModelSpec
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    remat: str = "none"
    attention: Callable = causal_attention

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
            (c.vocab_size, c.d_model),
            self.param_dtype,
        )
        x = embed(tokens, table, c.vocab_size, self.dtype)
        block = block_class(self.remat)
        for i in range(c.n_layers):
            x = block(c, self.dtype, self.param_dtype, self.attention, name=f"block_{i}")(x)
        x = final_norm(self.dtype, self.param_dtype, name="final_norm")(x)
        return as_logits(head(c, self.dtype, self.param_dtype, name="head")(x))


def next_token_loss(logits, targets, mask, one_hot: bool = False):
    """(sum of per-token cross-entropy over valid tokens, number of valid tokens).

    `one_hot`: the target's log-probability picked by a one-hot product rather than a gather
    (the same values): inside the pipeline's shard_map beside a split tensor axis, XLA's
    partitioner fails a check on the gather of vocab-split logits (trainspec.jax.pipeline)."""
    log_probs = jax.nn.log_softmax(logits)
    if one_hot:
        per_token = -jnp.sum(log_probs * jax.nn.one_hot(targets, logits.shape[-1],
                                                        dtype=logits.dtype), axis=-1)
    else:
        per_token = -jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum(per_token * mask), jnp.sum(mask)
