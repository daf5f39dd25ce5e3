"""The reference transformer in NumPy: its loss and gradient, by hand, in any float dtype.

The same maths as trainspec/jax/models/transformer.py and trainspec/torch/models/transformer.py
(RMSNorm with statistics per position, causal multi-head attention scaled by head_dim^-1/2, the tanh
form of GELU, a bias-free head, cross-entropy over the masked tokens), on parameters in the
flax tree layout (`{"embedding", "block_0": {"query": {"kernel"}, ...}, "final_norm", "head"}`).
Run in float64 it is the conformance suite's oracle (trainspec/core/golden.py); it imports no
framework, so any implementation can be checked against it.
"""
from __future__ import annotations

import numpy as np

RMS_EPSILON = 1e-6  # flax.linen.RMSNorm's default
GELU_C = np.sqrt(2.0 / np.pi)


def _rms_norm(x, scale):
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPSILON)
    return x * r * scale, (x, r, scale)


def _rms_norm_grad(dy, saved):
    x, r, scale = saved
    dn = dy * scale
    dx = r * dn - r**3 * x * np.mean(dn * x, axis=-1, keepdims=True)
    return dx, np.sum(dy * x * r, axis=tuple(range(x.ndim - 1)))


def _gelu(u):
    t = np.tanh(GELU_C * (u + 0.044715 * u**3))
    return 0.5 * u * (1 + t), t


def _gelu_grad(du, u, t):
    return du * (0.5 * (1 + t) + 0.5 * u * (1 - t * t) * GELU_C * (1 + 3 * 0.044715 * u * u))


def _attention(q, k, v):
    """q, k, v: (batch, length, heads, head_dim) -> the output and what the gradient needs."""
    scale = q.shape[-1] ** -0.5
    scores = np.einsum("bthd,bshd->bhts", q, k) * scale
    length = q.shape[1]
    causal = np.tril(np.ones((length, length), bool))
    scores = np.where(causal, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v), (q, k, v, p, scale)


def _attention_grad(da, saved):
    q, k, v, p, scale = saved
    dv = np.einsum("bhts,bthd->bshd", p, da)
    dp = np.einsum("bthd,bshd->bhts", da, v)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * scale
    return np.einsum("bhts,bshd->bthd", ds, k), np.einsum("bhts,bthd->bshd", ds, q), dv


def _block(x, w):
    h, norm1 = _rms_norm(x, w["attn_norm"]["scale"])
    q, k, v = (np.einsum("bte,ehd->bthd", h, w[n]["kernel"]) for n in ("query", "key", "value"))
    a, attn = _attention(q, k, v)
    x1 = x + np.einsum("bthd,hde->bte", a, w["out"]["kernel"])
    h2, norm2 = _rms_norm(x1, w["mlp_norm"]["scale"])
    u = h2 @ w["mlp_in"]["kernel"]
    g, t = _gelu(u)
    return x1 + g @ w["mlp_out"]["kernel"], (h, a, attn, norm1, h2, u, g, t, norm2)


def _block_grad(dx2, w, saved):
    h, a, attn, norm1, h2, u, g, t, norm2 = saved
    flat = lambda y: y.reshape(-1, y.shape[-1])  # noqa: E731
    grads = {"mlp_out": {"kernel": flat(g).T @ flat(dx2)}}
    du = _gelu_grad(dx2 @ w["mlp_out"]["kernel"].T, u, t)
    grads["mlp_in"] = {"kernel": flat(h2).T @ flat(du)}
    dx1, grads["mlp_norm"] = _rms_norm_grad(du @ w["mlp_in"]["kernel"].T, norm2)
    dx1 = dx1 + dx2
    grads["mlp_norm"] = {"scale": grads["mlp_norm"]}
    grads["out"] = {"kernel": np.einsum("bthd,bte->hde", a, dx1)}
    da = np.einsum("bte,hde->bthd", dx1, w["out"]["kernel"])
    dq, dk, dv = _attention_grad(da, attn)
    dh = 0
    for name, d in (("query", dq), ("key", dk), ("value", dv)):
        grads[name] = {"kernel": np.einsum("bte,bthd->ehd", h, d)}
        dh = dh + np.einsum("bthd,ehd->bte", d, w[name]["kernel"])
    dx, scale = _rms_norm_grad(dh, norm1)
    grads["attn_norm"] = {"scale": scale}
    return dx + dx1, grads


def loss_and_grad(params: dict, batch: dict, dtype=np.float64) -> tuple[float, float, dict]:
    """(sum of the masked tokens' cross-entropy, number of masked tokens, gradient of the sum)
    of the reference transformer on `batch` ({"inputs", "targets", "mask"}, (rows, length)),
    every operation in `dtype`."""
    w = _cast(params, dtype)
    tokens, mask = batch["inputs"], np.asarray(batch["mask"], dtype)
    x = w["embedding"][tokens]
    blocks = sorted((k for k in w if k.startswith("block_")), key=lambda k: int(k[6:]))
    saved = []
    for name in blocks:
        x, s = _block(x, w[name])
        saved.append(s)
    xf, final = _rms_norm(x, w["final_norm"]["scale"])
    logits = xf @ w["head"]["kernel"]
    shifted = logits - logits.max(-1, keepdims=True)
    log_z = np.log(np.sum(np.exp(shifted), -1))
    picked = np.take_along_axis(shifted, batch["targets"][..., None], -1)[..., 0]
    loss_sum = np.sum((log_z - picked) * mask)
    dlogits = np.exp(shifted - log_z[..., None])
    np.put_along_axis(dlogits, batch["targets"][..., None],
                      np.take_along_axis(dlogits, batch["targets"][..., None], -1) - 1, -1)
    dlogits *= mask[..., None]
    grads = {"head": {"kernel": xf.reshape(-1, xf.shape[-1]).T
                      @ dlogits.reshape(-1, dlogits.shape[-1])}}
    dx, scale = _rms_norm_grad(dlogits @ w["head"]["kernel"].T, final)
    grads["final_norm"] = {"scale": scale}
    for name, s in zip(reversed(blocks), reversed(saved)):
        dx, grads[name] = _block_grad(dx, w[name], s)
    embedding = np.zeros_like(w["embedding"])
    np.add.at(embedding, tokens, dx)
    grads["embedding"] = embedding
    return float(loss_sum), float(np.sum(mask)), grads


def _cast(tree, dtype):
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    return np.asarray(tree, dtype)
