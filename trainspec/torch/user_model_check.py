"""A user's model (`--model`, trainspec.core.user_model) checked for torch before any rank
starts: its `init()` built on the meta device (shapes only, nothing allocated), so that a wrong
`init` (a JAX model's, one returning something else) is one line, not a traceback per rank."""
from __future__ import annotations

import torch

from trainspec.core.errors import UserInputError
from trainspec.core.user_model import UserModel, user_error

EXPECTED = ("on torch, init() takes no argument and returns a torch.nn.Module "
            "(docs/adapters.md)")


def check_init(model: UserModel) -> None:
    try:
        with torch.device("meta"):
            built = model.init()
    except Exception as err:  # noqa: BLE001  the user's code
        raise UserInputError(f"--model: init() raised {user_error(err)}; {EXPECTED}; a JAX "
                             "model's init takes a random key (--framework jax)") from None
    if not isinstance(built, torch.nn.Module):
        raise UserInputError(f"--model: init() returned {type(built).__name__}; {EXPECTED}")
