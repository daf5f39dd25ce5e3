"""The reference job's training steps in NumPy: initial parameters, learning rate schedule,
gradient clipping and the optimizers, as the implementations define them with optax (JAX) and
torch.optim (PyTorch); with trainspec.core.reference_model, the conformance suite's oracle.

- `initial_params(model, seed)`: the flax tree, drawn from a stream that NumPy guarantees
  across releases (a bit generator's raw output, not a distribution method);
- `learning_rate(optimizer, total_steps, count)`: linear warm-up from 0 (none when
  `warmup_steps = 0`), cosine decay to a tenth (optax.warmup_cosine_decay_schedule);
- `Trainer`: one step at a time, token-weighted over the whole batch, clipped as
  optax.clip_by_global_norm, updated as optax.adamw (b1 0.9, b2 0.999, eps 1e-8) or
  optax.sgd (momentum 0.9);
- `digest(params, start)`: a few numbers per parameter that tell updates apart.
"""
from __future__ import annotations

import math

import numpy as np

from trainspec.core.reference_model import loss_and_grad
from trainspec.core.spec import ModelSpec, OptimizerSpec, Spec

ADAM_B1, ADAM_B2, ADAM_EPS, SGD_MOMENTUM = 0.9, 0.999, 1e-8, 0.9
DIGEST_PROJECTIONS = 4


def leaves(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """The tree's arrays by path ('block_0/query/kernel'), in sorted order."""
    out = {}
    for key in sorted(tree):
        path = f"{prefix}{key}"
        if isinstance(tree[key], dict):
            out.update(leaves(tree[key], path + "/"))
        else:
            out[path] = np.asarray(tree[key])
    return out


def tree_map(fn, *trees):
    if isinstance(trees[0], dict):
        return {k: tree_map(fn, *(t[k] for t in trees)) for k in trees[0]}
    return fn(*trees)


def param_shapes(c: ModelSpec) -> dict:
    """The flax parameter tree's shapes (trainspec/jax/models/transformer.py; with `moe`, each
    block's MLP is trainspec/jax/models/moe.py's router and expert kernels)."""
    hd = c.d_model // c.n_heads
    mlp = ({"mlp_in": {"kernel": (c.d_model, c.d_ff)}, "mlp_out": {"kernel": (c.d_ff, c.d_model)}}
           if c.moe is None else
           {"moe": {"router": (c.d_model, c.moe.experts),
                    "mlp_in": (c.moe.experts, c.d_model, c.d_ff),
                    "mlp_out": (c.moe.experts, c.d_ff, c.d_model)}})
    block = {"attn_norm": {"scale": (c.d_model,)}, "mlp_norm": {"scale": (c.d_model,)},
             **{n: {"kernel": (c.d_model, c.n_heads, hd)} for n in ("query", "key", "value")},
             "out": {"kernel": (c.n_heads, hd, c.d_model)}, **mlp}
    return {"embedding": (c.vocab_size, c.d_model), "final_norm": {"scale": (c.d_model,)},
            "head": {"kernel": (c.d_model, c.vocab_size)},
            **{f"block_{i}": block for i in range(c.n_layers)}}


def _normal(seed: int, path: str, shape) -> np.ndarray:
    """Standard normal draws by Box-Muller from PCG64's raw 64-bit words, whose stream NumPy
    keeps fixed across releases (NEP 19); seeded by the spec's seed and the parameter path."""
    n = math.prod(shape)
    words = np.random.PCG64([seed, *path.encode()]).random_raw(2 * ((n + 1) // 2))
    u = ((words >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53  # in (0, 1)
    u1, u2 = u[0::2], u[1::2]
    radius = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])
    return z[:n].reshape(shape)


def initial_params(c: ModelSpec, seed: int) -> dict:
    """float32 parameters with the implementations' distributions: embedding N(0, 1), kernels
    N(0, 1/fan_in) (fan_in: the input dimensions), norm scales 1."""
    def draw(path, shape):
        if path.endswith("scale"):
            return np.ones(shape, np.float32)
        n_in = 2 if path.endswith("/out/kernel") else 1  # attention's out: (heads, kv) in
        fan_in = 1 if path == "embedding" else math.prod(shape[:n_in])
        if "/moe/mlp_" in path:  # an expert's kernel: (experts, in, out)
            fan_in = shape[1]
        return (_normal(seed, path, shape) * fan_in**-0.5).astype(np.float32)
    return _build(param_shapes(c), draw)


def _build(shapes: dict, fn, prefix: str = "") -> dict:
    return {k: _build(v, fn, f"{prefix}{k}/") if isinstance(v, dict) else fn(prefix + k, v)
            for k, v in shapes.items()}


def learning_rate(o: OptimizerSpec, total_steps: int, count: int) -> float:
    """The learning rate of update number `count` (0-based): linear warm-up from 0, then cosine
    decay to a tenth; optax's schedule in trainspec.jax.train.make_optimizer, and torch's."""
    warmup = min(o.warmup_steps, total_steps - 1)
    decay = max(total_steps, 2)
    if count < warmup:
        return o.learning_rate * count / warmup
    t = min(count - warmup, decay - warmup) / (decay - warmup)
    return o.learning_rate * (0.9 * 0.5 * (1 + math.cos(math.pi * t)) + 0.1)


def global_norm(tree: dict) -> float:
    return math.sqrt(sum(float(np.sum(np.square(v))) for v in leaves(tree).values()))


class Trainer:
    """The reference job's optimizer state and steps, every number in `dtype`."""

    def __init__(self, spec: Spec, params: dict, dtype=np.float64):
        self.spec, self.dtype, self.count = spec, dtype, 0
        self.params = tree_map(lambda p: np.asarray(p, dtype), params)
        zeros = lambda p: np.zeros_like(p)  # noqa: E731
        self.mu, self.nu = tree_map(zeros, self.params), tree_map(zeros, self.params)

    def gradient(self, batch: dict) -> tuple[float, dict]:
        """(loss, gradient) of the whole batch: sums over every token, divided once by the
        number of valid tokens (trainspec/core/accumulation.py)."""
        loss_sum, tokens, grads = loss_and_grad(self.params, batch, self.dtype)
        denom = max(tokens, 1.0)
        return loss_sum / denom, tree_map(lambda g: g / self.dtype(denom), grads)

    def learning_rate(self) -> float:
        """The learning rate of the next update."""
        return learning_rate(self.spec.optimizer, self.spec.train.steps, self.count)

    def decayed(self, param: np.ndarray) -> np.ndarray:
        """What weight decay pulls towards zero: every parameter, norm scales included, as
        optax.adamw and torch.optim.AdamW do without a mask or parameter groups."""
        return param

    def step(self, batch: dict) -> tuple[float, float]:
        """One optimizer step on the global batch: (loss, gradient norm before clipping)."""
        loss, grads = self.gradient(batch)
        return loss, self.apply(grads)

    def apply(self, grads: dict) -> float:
        """Clip, then update with the optimizer; the gradient's global norm before clipping."""
        o, norm = self.spec.optimizer, global_norm(grads)
        if o.grad_clip_norm is not None and norm >= o.grad_clip_norm:
            grads = tree_map(lambda g: g / self.dtype(norm) * self.dtype(o.grad_clip_norm), grads)
        lr = self.dtype(self.learning_rate())
        self.count += 1
        if o.name == "adamw":
            self.mu = tree_map(lambda m, g: ADAM_B1 * m + (1 - ADAM_B1) * g, self.mu, grads)
            self.nu = tree_map(lambda v, g: ADAM_B2 * v + (1 - ADAM_B2) * g * g, self.nu, grads)
            c1, c2 = 1 - ADAM_B1**self.count, 1 - ADAM_B2**self.count
            update = tree_map(lambda m, v, p: (m / c1) / (np.sqrt(v / c2) + ADAM_EPS)
                              + o.weight_decay * self.decayed(p), self.mu, self.nu, self.params)
        else:
            self.mu = tree_map(lambda t, g: g + SGD_MOMENTUM * t, self.mu, grads)
            update = self.mu
        self.params = tree_map(lambda p, u: (p - lr * u).astype(self.dtype), self.params, update)
        return norm


def _projections(size: int, path: str) -> np.ndarray:
    """DIGEST_PROJECTIONS fixed +-1 vectors of `size` elements (from PCG64's raw stream)."""
    words = np.random.PCG64([7, *path.encode()]).random_raw(DIGEST_PROJECTIONS * size)
    return np.where(words & np.uint64(1), 1.0, -1.0).reshape(DIGEST_PROJECTIONS, size)


def digest(params: dict, start: dict) -> dict[str, list[float]]:
    """Per parameter, its update since `start` as [L2 norm, then its dot products with
    DIGEST_PROJECTIONS fixed random sign vectors]: two updates that differ by e (L2) give
    projections that differ by about e each, whatever the parameter's size."""
    before = leaves(start)
    out = {}
    for path, value in leaves(params).items():
        delta = (np.asarray(value, np.float64) - before[path].astype(np.float64)).reshape(-1)
        out[path] = [float(np.linalg.norm(delta)), *(_projections(delta.size, path) @ delta)]
    return out
