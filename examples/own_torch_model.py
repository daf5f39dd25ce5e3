"""Your own PyTorch model and data, trained by `trainspec train --framework torch --model
examples/own_torch_model.py:make`: an MLP regressing a fixed smooth function of 8 inputs,
wrapped by `trainspec.torch.wrap` under the spec (docs/adapters.md). The JAX counterpart is
examples/own_model.py."""
import numpy as np
import torch
from torch import nn

from trainspec.core.user_model import UserModel

FEATURES, HIDDEN = 8, 32
LEARNING_RATE = 3e-2


def make(spec) -> UserModel:
    target = np.random.default_rng(0).normal(size=FEATURES).astype(np.float32)

    def model():
        return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))

    def loss(model, batch):
        error = model(batch["x"])[:, 0] - batch["y"]
        return (error**2).sum(), error.numel()

    def batches(index, stream=0):
        x = np.random.default_rng([spec.seed, index, stream]).normal(
            size=(spec.batch.global_batch, FEATURES)).astype(np.float32)
        return {"x": x, "y": np.sin(x @ target)}

    def eval_batches(index):  # [eval]: inputs no training batch draws
        return batches(index, stream=1)

    def optimizer(params):
        # the model's own optimizer governs, its learning rate included (docs/wrapping.md)
        return torch.optim.Adam(params, lr=LEARNING_RATE)

    # 2 FLOPs per multiply-add of the two weights, forward + backward = 3 x forward, per row
    flops = 6 * (FEATURES * HIDDEN + HIDDEN) * spec.batch.global_batch
    # rows of 8 features, no sequence: a row is what the records count as a token
    return UserModel(model, loss, batches, flops_per_step=flops, optimizer=optimizer,
                     eval_batches=eval_batches, sequences=False)
