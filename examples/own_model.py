"""Your own JAX model and data, trained by `trainspec train --model examples/own_model.py:make`
(and laid out by `trainspec validate SPEC --model examples/own_model.py:make`): a flax MLP
regressing a fixed smooth function of 8 inputs, its kernels named for the layout rules
(docs/wrapping.md). Nothing of the reference job; tests/jax/test_own_loop.py trains it."""
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from trainspec.core.user_model import UserModel

FEATURES, HIDDEN = 8, 32
LEARNING_RATE = 3e-2


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        x = nn.tanh(nn.Dense(HIDDEN, kernel_init=kernel)(x))
        head = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        return nn.Dense(1, kernel_init=head)(x)[:, 0]


def make(spec) -> UserModel:
    model, tx = MLP(), optax.adam(LEARNING_RATE)
    target = np.random.default_rng(0).normal(size=FEATURES).astype(np.float32)

    def init(rng):
        params = model.init(rng, jnp.zeros((1, FEATURES)))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss(params, batch):
        error = model.apply({"params": params}, batch["x"]) - batch["y"]
        # aux: summed over micro-batches like the loss, recorded as metrics.jsonl's `aux`
        return jnp.sum(error**2), jnp.float32(error.size), {"abs_error_sum": jnp.sum(abs(error))}

    def batches(index, stream=0):
        x = np.random.default_rng([spec.seed, index, stream]).normal(
            size=(spec.batch.global_batch, FEATURES)).astype(np.float32)
        return {"x": x, "y": np.sin(x @ target)}

    def eval_batches(index):  # [eval]: inputs no training batch draws
        return batches(index, stream=1)

    # 2 FLOPs per multiply-add of the two kernels, forward + backward = 3 x forward, per row
    flops = 6 * (FEATURES * HIDDEN + HIDDEN) * spec.batch.global_batch
    # rows of 8 features, no sequence: a row is what the records count as a token
    return UserModel(init, loss, batches, flops_per_step=flops, sequences=False,
                     schedule=lambda updates: LEARNING_RATE, eval_batches=eval_batches)
