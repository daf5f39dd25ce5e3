"""A user's model (`--model`, trainspec.core.user_model) checked for JAX before anything runs:
its `init(rng)` traced for shapes only (nothing allocated), so that a wrong `init` (a torch
model's, one returning something else) is one line, not a traceback from every process."""
from __future__ import annotations

import jax

from trainspec.core.errors import UserInputError
from trainspec.core.user_model import UserModel, user_error

EXPECTED = ("on JAX, init(rng) takes a random key and returns a flax TrainState (with .params "
            "and .apply_gradients; docs/wrapping.md)")


def check_init(model: UserModel, seed: int) -> None:
    try:
        state = jax.eval_shape(model.init, jax.random.key(seed))
    except Exception as err:  # noqa: BLE001  the user's code
        raise UserInputError(f"--model: init(rng) raised {user_error(err)}; {EXPECTED}; a "
                             "torch model's init takes no argument (--framework torch)") from None
    if not (hasattr(state, "params") and hasattr(state, "apply_gradients")):
        got = (f"an array of shape {state.shape}" if isinstance(state, jax.ShapeDtypeStruct)
               else type(state).__name__)
        raise UserInputError(f"--model: init(rng) returned {got}; {EXPECTED}")
