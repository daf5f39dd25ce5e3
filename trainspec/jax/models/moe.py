"""The reference transformer's mixture-of-experts MLP (docs/spec.md, `[model.moe]`): the
routing decisions of trainspec.core.moe in jax, and the experts split over the `expert` axes.

Routing (top-k, capacity, the drop order, the auxiliary losses) runs over the whole
micro-batch in the global view, and gives each (token, expert) pair its weight: the gate where
the expert took the token, 0 elsewhere. Under a split expert axis a `shard_map` does the rest:
each device sends each of its rows to the devices of the experts that took it (the dispatch
all-to-all over the expert axes), runs its own experts, and the combine all-to-all returns the
outputs, summed by the weights on the row's device. Both all-to-alls are
trainspec.jax.collectives calls, through the backend the wrapped step traces the model under
(the spec's `collectives.backend`: lax's, or the xla_ext custom calls). The buffers are
indexed by token, not by capacity slot: a row an expert did not take travels as zeros
(experts / top_k times the bytes of a slot-packed dispatch; the capacity bound is the
routing's, over the whole micro-batch). Without an expert axis every expert runs on every row,
weighted the same way.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from trainspec.core.moe import capacity
from trainspec.core.spec import ModelSpec
from trainspec.jax import collectives
from trainspec.jax.layout import gathered_for_use


def route(logits, top_k: int, capacity_factor: float) -> dict:
    """trainspec.core.moe.route for logits (tokens, experts): `weights` (tokens, experts), the
    gate of each kept (token, expert) assignment and 0 elsewhere, and the step's statistics."""
    tokens, experts = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    picked, chosen = jax.lax.top_k(probs, top_k)  # ties: the lower index first
    gates = picked / picked.sum(-1, keepdims=True)
    slots = capacity(tokens, experts, top_k, capacity_factor)
    choice = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)            # (t, k, e)
    # every first choice before any second choice, then token order
    ranked = jnp.swapaxes(choice, 0, 1).reshape(top_k * tokens, experts)
    slot = jnp.swapaxes(((jnp.cumsum(ranked, axis=0) - 1) * ranked).sum(-1)
                        .reshape(top_k, tokens), 0, 1)                    # (t, k)
    kept = slot < slots
    load = choice.sum((0, 1)).astype(probs.dtype)
    return {
        "weights": jnp.einsum("tke,tk->te", choice.astype(probs.dtype), gates * kept),
        "load": load,
        "dropped": jnp.sum(~kept),
        "balance": experts * jnp.sum(load / (tokens * top_k) * probs.mean(0)),
        "z": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
    }


def _experts(rows, weights, w_in, w_out):
    """Every expert on every row it is given, summed weighted per row: rows (t, d), weights
    (t, e), kernels (e, d, f) and (e, f, d)."""
    hidden = nn.gelu(jnp.einsum("td,edf->etf", rows, w_in))
    return jnp.einsum("te,etd->td", weights, jnp.einsum("etf,efd->etd", hidden, w_out))


def _expert_parallel(rows, weights, w_in, w_out, axes: tuple[str, ...]):
    """One device's rows through the experts of the whole expert axis: each row goes to the
    device of every expert that kept it (the dispatch all-to-all: row t of the buffer for
    expert e is x_t where e took t, zeros elsewhere), the device runs its own experts on what
    it received, and the combine all-to-all brings each output back to its row's device."""
    sent = (weights > 0).astype(rows.dtype)                                  # (t, e)
    buffer = sent.T[..., None] * rows[None]                                  # (e, t, d)
    received = collectives.all_to_all(buffer, axes, 0, 1)                    # (e_local, n t, d)
    hidden = nn.gelu(jnp.einsum("etd,edf->etf", received, w_in))
    out = collectives.all_to_all(jnp.einsum("etf,efd->etd", hidden, w_out), axes, 1, 0)
    return jnp.einsum("te,etd->td", weights, out)                            # (t, d)


class MoEMlp(nn.Module):
    """(batch, length, d_model) -> the same; the routing's statistics sown into the `moe`
    collection (`load`, `dropped`, `balance`, `z`)."""

    config: ModelSpec
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _kernel(self, name, shape, names, fan_in):
        """A kernel as the matmuls use it. An expert kernel stays split over the expert axes
        (which also split the batch: gathered_for_use would gather every expert onto every
        device); the router is gathered like the dense model's kernels."""
        init = nn.with_logical_partitioning(nn.initializers.normal(stddev=fan_in**-0.5), names)
        kernel = self.param(name, init, shape, self.param_dtype)
        used = kernel if "expert" in names else gathered_for_use(kernel, names)
        return used.astype(self.dtype)

    @nn.compact
    def __call__(self, x):
        c, moe = self.config, self.config.moe
        batch, length, d = x.shape
        rows = x.reshape(batch * length, d)
        router = self._kernel("router", (d, moe.experts), ("embed", None), d)
        r = route(rows.astype(jnp.float32) @ router.astype(jnp.float32), moe.top_k,
                  moe.capacity_factor)
        for name in ("load", "dropped", "balance", "z"):
            self.sow("moe", name, r[name])
        w_in = self._kernel("mlp_in", (moe.experts, d, c.d_ff), ("expert", "embed", "mlp"), d)
        w_out = self._kernel("mlp_out", (moe.experts, c.d_ff, d), ("expert", "mlp", "embed"),
                             c.d_ff)
        weights = r["weights"].astype(self.dtype)
        mesh = jax.sharding.get_abstract_mesh()
        rules = dict(nn.get_logical_axis_rules())
        axes = tuple(a for a in rules.get("expert") or () if not mesh.empty and mesh.shape[a] > 1)
        if not axes:
            return _experts(rows, weights, w_in, w_out).reshape(batch, length, d)
        batch_axes = tuple(a for a in rules["batch"] if mesh.shape[a] > 1)
        if rows.shape[0] % int(np.prod([mesh.shape[a] for a in batch_axes])):
            batch_axes = axes  # init traces one row per sequence: split over the experts only
        token_spec, kernel_spec = P(batch_axes, None), P(axes, None, None)
        # check_vma off: a custom-call backend's gradients are custom VJPs, opaque to the
        # varying-manual-axes check
        y = jax.shard_map(functools.partial(_expert_parallel, axes=axes),
                          in_specs=(token_spec, token_spec, kernel_spec, kernel_spec),
                          out_specs=token_spec, check_vma=False)(rows, weights, w_in, w_out)
        return y.reshape(batch, length, d)


def moe_losses_and_stats(sown: dict, moe) -> tuple[jax.Array, dict]:
    """From the `moe` collection of one forward pass: the weighted auxiliary loss per token
    (summed over layers) and the statistics a step reports (trainspec.core.records.moe_fields):
    per-layer expert load, dropped assignments, and the losses summed with their count."""
    layers = [sown[name]["moe"] for name in sorted(sown, key=lambda n: int(n.split("_")[1]))]
    balance = sum(layer["balance"][0] for layer in layers)
    z = sum(layer["z"][0] for layer in layers)
    stats = {
        "moe_load": jnp.stack([layer["load"][0] for layer in layers]),
        "moe_dropped": sum(layer["dropped"][0] for layer in layers).astype(jnp.float32),
        "moe_balance": balance,
        "moe_z": z,
        "moe_layers": jnp.float32(len(layers)),
    }
    return moe.load_balance_weight * balance + moe.z_loss_weight * z, stats
