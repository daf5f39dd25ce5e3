"""What a user hands `trainspec.torch.wrap`, checked where it enters: the mesh against the spec's
axes, the model `model_fn` builds (seeded, cast, rank 0's copy on every rank, attending across
the context ranks where that axis is split), the optimizer `optimizer_fn` builds, what
`loss_fn` returns and the rows of a batch. Each refusal is one line naming the argument."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainspec.core.errors import UserInputError
from trainspec.torch.reduction import packed


def check_mesh(mesh: DeviceMesh, sizes: dict[str, int]) -> None:
    have = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape))
    if have != sizes:
        raise UserInputError(f"mesh: its axes {have} are not the spec's mesh.axes {sizes} on "
                             f"{mesh.size()} ranks")


def build_model(model_fn: Callable[..., nn.Module], seed: int, device: torch.device,
                dtype: torch.dtype, attention: Callable | None = None) -> nn.Module:
    """`model_fn()` with torch's generator seeded by `seed` (`model_fn(attention=...)` where
    the context axis is split), on `device` in `dtype`, holding rank 0's parameters and
    buffers on every rank (as DDP does)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_fn() if attention is None else with_attention(model_fn, attention)
    if not isinstance(model, nn.Module):
        raise UserInputError(f"model_fn: returned a {type(model).__name__}, not a "
                             "torch.nn.Module")
    model.to(device=device, dtype=dtype)
    if dist.get_world_size() > 1:
        for tensors in _by_dtype([*model.parameters(), *model.buffers()]).values():
            packed(tensors, lambda flat: dist.broadcast(flat, src=0))
    return model


def with_attention(model_fn: Callable, attention: Callable) -> nn.Module:
    """`model_fn(attention=...)` under a split context axis: the model attends through the
    context ranks (trainspec.torch.context.ContextSplit.attention), or it would see its own
    part of each sequence only."""
    if "attention" not in inspect.signature(model_fn).parameters:
        raise UserInputError(
            "mesh.axes.context: a split context axis needs a model_fn that takes `attention`, "
            "the causal attention of (batch, heads, length, head_dim) tensors across the context "
            "ranks, and uses it in place of its own (docs/adapters.md)")
    return model_fn(attention=attention)


def check_optimizer(optimizer, model: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserInputError(f"optimizer_fn: returned a {type(optimizer).__name__}, not a "
                             "torch.optim.Optimizer")
    held = {id(q) for group in optimizer.param_groups for q in group["params"]}
    missing = [n for n, q in model.named_parameters() if q.requires_grad and id(q) not in held]
    if missing:
        raise UserInputError(
            f"optimizer_fn: {len(missing)} trainable parameters are not in its optimizer (first: "
            f"{missing[0]}); build it from the parameters it is given, which are laid out")


def check_loss(result) -> None:
    """What `loss_fn` returned must be (loss_sum, valid_tokens), the sum a scalar with a
    gradient."""
    ok = (isinstance(result, tuple) and len(result) == 2
          and isinstance(result[0], torch.Tensor) and result[0].dim() == 0
          and result[0].requires_grad)
    if not ok:
        raise UserInputError(
            "loss_fn: expected (loss_sum, valid_tokens), the summed per-token losses as "
            "a scalar tensor that requires grad and the token count; got "
            f"{_describe(result)}")


def local_rows(batch: Mapping, global_batch: int, rows: slice,
               device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's `rows` of `batch` on `device`: a dict of arrays holding the global batch or
    those rows already."""
    if not isinstance(batch, Mapping):
        raise UserInputError(f"batch: expected a dict of arrays, got a {type(batch).__name__}")
    per = rows.stop - rows.start
    local = {}
    for key, value in batch.items():
        t = torch.as_tensor(value)
        n = t.shape[0] if t.dim() else 0
        if n not in (global_batch, per):
            raise UserInputError(
                f"batch[{key!r}] has {n} rows; expected batch.global_batch = {global_batch} (the "
                f"global batch) or {per} (this rank's rows, step.rows())")
        local[key] = (t[rows] if n != per else t).to(device)
    return local


def _describe(value) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}: ({', '.join(_describe(v) for v in value)})"
    if isinstance(value, torch.Tensor):
        grad = ", no grad" if not value.requires_grad else ""
        return f"a tensor of shape {tuple(value.shape)}{grad}"
    return f"a {type(value).__name__}"


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups
