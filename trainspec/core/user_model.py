"""A user's own model and data for `trainspec train --model module:fn` and
`trainspec validate --model module:fn`: `fn(spec)` returns a `UserModel`.

`module` is a Python file (`path/to/my_model.py`) or an importable module (`pkg.my_model`).
What `init` and `loss` are depends on the framework that trains it (docs/wrapping.md for JAX,
docs/adapters.md for torch); `batches` and `flops_per_step` mean the same on both.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainspec.core.errors import UserInputError
from trainspec.core.flops import tokens_per_step
from trainspec.core.spec import load_spec

TRAINSPEC_ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class UserModel:
    """What `fn(spec)` returns.

    - `init`: JAX: `init(rng) -> state`, a flax TrainState (anything with `.params` and
      `.apply_gradients`), built under the spec's layout as `WrappedStep.init` builds it;
      torch: `init() -> nn.Module`, the `model_fn` of `trainspec.torch.wrap`.
    - `loss`: JAX: `loss(params, batch) -> (loss_sum, valid_tokens, aux)`, as for
      `trainspec.jax.loss_step`; torch: `loss(model, batch) -> (loss_sum, valid_tokens)`, as
      for `trainspec.torch.wrap`. Either way the step accumulates micro-batches and weights by
      tokens.
    - `optimizer`: torch only, optional: `optimizer(params) -> torch.optim.Optimizer`; on JAX
      the optimizer is the state's. A model's own optimizer governs on both frameworks: its
      update rule, learning rate and any clipping are its own, and the spec's `[optimizer]`
      applies only where the model brings none (torch without `optimizer`).
    - `batches(index) -> {name: NumPy array}`: the whole global batch number `index` (0-based),
      a pure function of it, so that a resume continues with exactly the next batch; dimension 0
      is the batch (`batch.global_batch` rows), dimension 1 the sequence where there is one.
    - `flops_per_step`: the model's FLOPs of one optimizer step over the whole global batch
      (forward + backward), for MFU; None: MFU is null (XLA's count still gives HFU on JAX).
    - `schedule(updates) -> learning rate` for the records on JAX; None: null (torch records
      its optimizer's learning rate, or the spec's schedule where it builds the optimizer).
    - `eval_batches(index) -> {name: NumPy array}`: optional, the eval hook of `[eval]`:
      held-out global batch `index` (0-based, as `batches`), whose loss `loss` gives the
      records' `eval_loss`; `eval.interval > 0` without it is refused in one line.
    - `sequences`: False for a model whose rows have no sequence dimension (a regression, a
      classifier of vectors): a row is then the unit the records count as a token, and the job
      runs with `batch.seq_len = 1` (`spec_for`), so no length the data does not have enters
      `batch_tokens`, `padded_tokens_per_s` or the FLOPs per token.
    - `tensor_plan`, `fsdp_units`: torch only, `trainspec.torch.wrap`'s arguments of those
      names ({module name: ParallelStyle}; module-name rules for FSDP2 units); None: the
      defaults. On JAX the spec's `layout.rules` split a model by its logical axis names.
    """

    init: Callable[..., Any]
    loss: Callable[..., Any]
    batches: Callable[[int], dict]
    flops_per_step: float | None = None
    schedule: Callable[[int], float] | None = None
    optimizer: Callable | None = None
    tensor_plan: dict | None = None
    fsdp_units: Sequence[str] | None = None
    eval_batches: Callable[[int], dict] | None = None
    sequences: bool = True

    def train_rows(self, rows: slice) -> Callable[[int], dict]:
        """Batch `index`, this process's `rows` of it."""
        return _rows_of(self.batches, rows)

    def eval_rows(self, rows: slice) -> Callable[[int], dict] | None:
        """Eval batch `index`, this process's `rows` of it; None without `eval_batches`."""
        return self.eval_batches and _rows_of(self.eval_batches, rows)

    def model_flops(self, spec):
        """The records' FLOPs formula (trainspec.core.flops.ModelFlops), or None."""
        if self.flops_per_step is None:
            return None
        return PerToken(self.flops_per_step / tokens_per_step(spec))


def spec_for(spec, model: UserModel | None):
    """The spec a job runs under with `model` (None: the reference job's): a model without
    sequences counts one token per row, so `batch.seq_len` is 1 whatever the spec says (the
    spec a run dir keeps, and the one a resume must match)."""
    if model is None or model.sequences or spec.batch.seq_len == 1:
        return spec
    data = spec.to_dict()
    data["batch"]["seq_len"] = 1
    return load_spec(data)


def _rows_of(batches: Callable[[int], dict], rows: slice) -> Callable[[int], dict]:
    return lambda index: {name: x[rows] for name, x in batches(index).items()}


@dataclasses.dataclass(frozen=True)
class PerToken:
    """A model's FLOPs as the user gives them, per token position of the spec's batch
    (`global_batch x seq_len`, as the records count them), whatever the convention."""

    flops: float

    def model_per_token(self, convention: str) -> float:
        return self.flops

    def hardware_per_token(self) -> float:
        return self.flops


def load(reference: str, spec) -> UserModel:
    """`fn(spec)` for `reference` = "module:fn"; UserInputError in one line naming --model,
    whatever the user's code does wrong: a file that does not import (a syntax error, an
    import of its own that fails), a function that takes other arguments, raises, or returns
    something else."""
    module_name, sep, fn_name = reference.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise UserInputError(f"--model: expected MODULE:FUNCTION (a .py file or a module), "
                             f"got {reference!r}")
    module = _module(module_name)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserInputError(f"--model: {module_name} has no function {fn_name!r}")
    try:
        inspect.signature(fn).bind(spec)
    except TypeError:
        raise UserInputError(f"--model: {reference} takes {inspect.signature(fn)}; expected "
                             "one argument, the spec") from None
    except ValueError:  # no signature to read (a builtin): calling it tells
        pass
    try:
        made = fn(spec)
    except Exception as err:  # noqa: BLE001  the user's code: any error, said in one line
        raise UserInputError(f"--model: {reference} raised {user_error(err)}") from None
    if not isinstance(made, UserModel):
        raise UserInputError(f"--model: {reference} returned {type(made).__name__}, expected a "
                             "trainspec.core.user_model.UserModel")
    return made


def user_error(err: BaseException) -> str:
    """An error of the user's code in one line: its type, its message's first line, and where
    in the user's code it was raised (the innermost frame outside trainspec)."""
    text = str(err.msg if isinstance(err, SyntaxError) else err).strip().splitlines()
    where = [frame for frame in traceback.extract_tb(err.__traceback__)
             if TRAINSPEC_ROOT not in Path(frame.filename).parents]
    if isinstance(err, SyntaxError) and err.filename:
        at = f" ({err.filename}:{err.lineno})"
    else:
        at = f" ({where[-1].filename}:{where[-1].lineno})" if where else ""
    return f"{type(err).__name__}{': ' + text[0][:200] if text else ''}{at}"


def _module(name: str):
    """The module a file path or a dotted name names. A file's directory goes on sys.path
    first, as `python file.py` puts it, so that the file imports the modules beside it."""
    try:
        if name.endswith(".py"):
            return _module_from_file(Path(name))
        return importlib.import_module(name)
    except UserInputError:
        raise
    except Exception as err:  # noqa: BLE001  importing runs the user's code
        raise UserInputError(f"--model: importing {name} failed: {user_error(err)}") from None


def _module_from_file(path: Path):
    if not path.is_file():
        raise UserInputError(f"--model: no such file {path}")
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location(f"trainspec_user_model_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module
