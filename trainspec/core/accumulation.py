"""The token-weighted accumulation rule (docs/spec.md), as a NumPy reference.

A step over a global batch of B sequences runs k = global_batch / micro_batch micro-batches.
Micro-batch j holds rows j, j+k, j+2k, ... of the batch, so that every micro-batch stays spread
over all batch shards (a contiguous split would put micro-batch 0 on the first devices only).

The loss of the step is the sum of the per-token losses over all micro-batches *and all
data-parallel shards*, divided once by the total number of valid (unmasked) tokens of the
global batch; its gradient is the gradient of that quotient. The mean of per-micro-batch means
(`mean_of_means`, what DeepSpeed does by default) differs as soon as the masks are ragged, and
is here only so that tests can show the difference.

Implementations (the JAX `loss_step`, the torch adapter) accumulate the sums and divide once;
their results must match `token_weighted` within floating-point summation error.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def interleaved_micro_batches(x, k: int):
    """(B, ...) -> (k, B/k, ...) with micro-batch j = rows j, j+k, j+2k, ...

    Written with array methods only, so the same rule runs on NumPy, jax and torch arrays.
    """
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
    return x.swapaxes(0, 1)


def token_weighted(loss_sums: Sequence[float], valid_tokens: Sequence[float],
                   grad_sums: Sequence[np.ndarray] | None = None):
    """The step's loss (and gradient) from per-micro-batch (or per-shard) sums, in float64.

    `loss_sums[i]`: sum of per-token losses of part i; `valid_tokens[i]`: its unmasked tokens;
    `grad_sums[i]`: the gradient of `loss_sums[i]`. A batch without valid tokens has loss 0
    (the divisor is at least 1), so a fully masked step is a no-op, not a NaN.
    """
    denom = max(float(np.sum(np.asarray(valid_tokens, np.float64))), 1.0)
    loss = float(np.sum(np.asarray(loss_sums, np.float64))) / denom
    if grad_sums is None:
        return loss
    grad = np.sum([np.asarray(g, np.float64) for g in grad_sums], axis=0) / denom
    return loss, grad


def mean_of_means(loss_sums: Sequence[float], valid_tokens: Sequence[float]) -> float:
    """The rule the spec rejects: each part's mean loss, averaged with equal weights."""
    sums, tokens = np.asarray(loss_sums, np.float64), np.asarray(valid_tokens, np.float64)
    return float(np.mean(sums / np.maximum(tokens, 1.0)))
