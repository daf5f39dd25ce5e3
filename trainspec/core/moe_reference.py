"""The MoE reference model's loss in NumPy float64, forward only: the conformance suite's
oracle for the first step of a mixture-of-experts job (trainspec/core/conformance_experts.py).

The reference transformer (trainspec/core/reference_model.py) with every block's MLP the MoE
layer of trainspec.core.moe over the whole batch's tokens (rows in order, then positions), and
the auxiliary losses added per token as the reference job adds them: the mean cross-entropy
over the masked tokens plus, per layer, load_balance_weight x the load-balancing loss and
z_loss_weight x the z-loss.
"""
from __future__ import annotations

import numpy as np

from trainspec.core.moe import load_balance_loss, moe_layer, z_loss
from trainspec.core.reference_model import _attention, _cast, _gelu, _rms_norm
from trainspec.core.spec_sequence import MoESpec


def _moe_block(x, w, moe: MoESpec) -> tuple[np.ndarray, float, int]:
    """(the block's output, its weighted auxiliary loss, its dropped assignments)."""
    h, _ = _rms_norm(x, w["attn_norm"]["scale"])
    q, k, v = (np.einsum("bte,ehd->bthd", h, w[n]["kernel"]) for n in ("query", "key", "value"))
    a, _ = _attention(q, k, v)
    x1 = x + np.einsum("bthd,hde->bte", a, w["out"]["kernel"])
    h2, _ = _rms_norm(x1, w["mlp_norm"]["scale"])
    rows = h2.reshape(-1, h2.shape[-1])
    e = w["moe"]

    def expert(i, taken):
        return _gelu(taken @ e["mlp_in"][i])[0] @ e["mlp_out"][i]

    y, routing = moe_layer(rows, e["router"], expert, moe.top_k, moe.capacity_factor)
    aux = (moe.load_balance_weight * load_balance_loss(routing)
           + moe.z_loss_weight * z_loss(rows @ e["router"]))
    return x1 + y.reshape(x1.shape), aux, routing.dropped


def loss(params: dict, batch: dict, moe: MoESpec) -> tuple[float, int]:
    """(the loss per masked token, auxiliary losses included; the dropped assignments summed
    over layers) of the MoE reference model on `batch`, in float64."""
    w = _cast(params, np.float64)
    mask = np.asarray(batch["mask"], np.float64)
    x = w["embedding"][batch["inputs"]]
    blocks = sorted((k for k in w if k.startswith("block_")), key=lambda k: int(k[6:]))
    aux, dropped = 0.0, 0
    for name in blocks:
        x, block_aux, block_dropped = _moe_block(x, w[name], moe)
        aux, dropped = aux + block_aux, dropped + block_dropped
    xf, _ = _rms_norm(x, w["final_norm"]["scale"])
    logits = xf @ w["head"]["kernel"]
    shifted = logits - logits.max(-1, keepdims=True)
    log_z = np.log(np.sum(np.exp(shifted), -1))
    picked = np.take_along_axis(shifted, batch["targets"][..., None], -1)[..., 0]
    return float(np.sum((log_z - picked) * mask) / np.sum(mask) + aux), dropped
