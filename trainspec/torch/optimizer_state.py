"""The step's optimizer state: where it lives (`layout.optimizer_state`) and what its checkpoints
hold besides the optimizer's own (the error-feedback residual of `collectives.compression`).

`shard_over_data` is ZeRO-1 (Rajbhandari et al. 2020): every parameter's local block (the whole
parameter, or its FSDP2/DTensor shard) is cut, flat, into one contiguous slice per data replica
(ceil(n / replicas) elements, the last ones shorter). A replica keeps optimizer state for its
slices only, updates them in place (each slice is a view of the parameter's storage) and
all-gathers every replica's updated slices, packed into one buffer, after the update. The
gradients are all-reduced whole beforehand, as without it, so the global norm, clipping and the
non-finite decision are unchanged; an element-wise optimizer's update of a slice is the update
of the whole parameter, restricted to it.

Checkpoints hold the state in the `like_params` form (a sharded state gathered over the
replicas for the save, each laid out like its parameter), so either setting resumes the other's
checkpoints on any mesh; extra per-parameter state (`extra`) rides along under its own keys.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainspec.core.errors import UserInputError
from trainspec.torch.layout import local_block

# Optimizers whose update of an element depends on that element's gradient and state only.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad,
               torch.optim.Adadelta)


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """shard_over_data needs an optimizer whose update of an element is its own."""
    if type(optimizer) not in ELEMENTWISE:
        raise UserInputError(
            f"layout.optimizer_state: shard_over_data updates each data replica's slice of "
            f"every parameter, which only an element-wise optimizer allows "
            f"({', '.join(c.__name__ for c in ELEMENTWISE)}); got "
            f"{type(optimizer).__name__}; use like_params")


@dataclasses.dataclass
class ExtraState:
    """Per-parameter state kept outside the optimizer that checkpoints carry with it:
    `save()` -> {parameter: {key: tensor laid out like it}}; `load(that)` takes it back."""

    keys: tuple[str, ...]
    save: Callable[[], dict]
    load: Callable[[dict], None]


class StepOptimizer(torch.optim.Optimizer):
    """`optimizer` (over the model's parameters), its state split over the data replicas of
    `shard_group` when given, its checkpoints carrying `extra`. Its param_groups are
    `optimizer`'s: set hyperparameters (the learning rate) there as on any optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, shard_group=None,
                 extra: ExtraState | None = None):
        self.extra = extra
        self._slices: dict[nn.Parameter, Slice] = {}
        self.inner = optimizer
        if shard_group is not None:
            check_shardable(optimizer)
            self.group, self.replicas = shard_group, dist.get_world_size(shard_group)
            me = dist.get_rank(shard_group)
            for p in (p for g in optimizer.param_groups for p in g["params"]):
                flat = _flat_block(p)
                chunk = math.ceil(flat.numel() / self.replicas)
                start = min(me * chunk, flat.numel())
                piece = nn.Parameter(flat[start:start + chunk], requires_grad=p.requires_grad)
                self._slices[p] = Slice(piece, start, chunk)
            self.inner = _rebuilt(optimizer, lambda p: self._slices[p].piece)
        super().__init__(optimizer.param_groups, dict(optimizer.defaults))

    # The state is the inner optimizer's (truthy once initialised, as torch's checkpoint code
    # asks before it would take a step to initialise it).
    @property
    def state(self):
        return self.inner.state

    @state.setter
    def state(self, value):  # torch.optim.Optimizer.__init__ sets an empty one
        pass

    def _sync_hyperparameters(self) -> None:
        """A sharded inner optimizer has groups of its own: the outer ones' values, slices."""
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            if inner is not outer:
                inner.update({k: v for k, v in outer.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        self._sync_hyperparameters()
        for p, s in self._slices.items():
            s.piece.grad = None if p.grad is None else s.of(_flat_block(p.grad))
        self.inner.step()
        if self._slices:
            params = list(self._slices)
            pieces = [s.piece for s in self._slices.values()]
            for p, whole in zip(params, self._gather(params, pieces)):
                _flat_block(p).copy_(whole)

    def _gather(self, params: list, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every replica's pieces of `params` (this replica's: `pieces`) put together: each
        parameter's flat local block. One all-gather per dtype."""
        out: list = [None] * len(pieces)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, piece in enumerate(pieces):
            by_dtype.setdefault(piece.dtype, []).append(i)
        for dtype, indices in by_dtype.items():
            chunks = [self._slices[params[i]].chunk for i in indices]
            offsets = [sum(chunks[:j]) for j in range(len(chunks))]
            mine = torch.zeros(sum(chunks), dtype=dtype, device=pieces[indices[0]].device)
            every = torch.empty(self.replicas * sum(chunks), dtype=dtype, device=mine.device)
            for i, offset in zip(indices, offsets):
                mine[offset:offset + pieces[i].numel()] = pieces[i].reshape(-1)
            dist.all_gather_single(every, mine, group=self.group)
            every = every.view(self.replicas, -1)
            for i, offset, chunk in zip(indices, offsets, chunks):
                numel = local_block(params[i]).numel()
                out[i] = every[:, offset:offset + chunk].reshape(-1)[:numel]
        return out

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.optim.Optimizer.state_dict's form, every tensor state laid out like its
        parameter (gathered over the replicas when sharded), with the extra state's keys."""
        self._sync_hyperparameters()
        saved = self.inner.state_dict()
        # torch's state_dict holds the live per-parameter dicts: replace entries in copies
        state = saved["state"] = {i: dict(values) for i, values in saved["state"].items()}
        params = [p for g in self.param_groups for p in g["params"]]
        if self._slices:
            keys = sorted({k for values in state.values() for k, v in values.items()
                           if _sliced(v)})
            for key in keys:  # every replica holds the same keys for the same parameters
                held = [i for i in sorted(state) if _sliced(state[i].get(key))]
                whole = self._gather([params[i] for i in held], [state[i][key] for i in held])
                for i, flat in zip(held, whole):
                    state[i][key] = laid_out_like(params[i], flat)
        if self.extra is not None:
            extra = self.extra.save()
            for i, p in enumerate(params):
                if p in extra:
                    state.setdefault(i, {}).update(extra[p])
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """Take a state in state_dict()'s form (this replica's slices of it when sharded).
        As torch.optim.Optimizer.load_state_dict, the saved param_groups name the parameters,
        in this optimizer's order, by whatever keys the state uses (indices, or names)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = dict(zip(saved_ids, (p for g in self.param_groups for p in g["params"])))
        state, extra = {}, {}
        keys = self.extra.keys if self.extra is not None else ()
        for i, values in state_dict["state"].items():
            extra[params[i]] = {k: v for k, v in values.items() if k in keys}
            values = {k: v for k, v in values.items() if k not in keys}
            if self._slices:
                cut = self._slices[params[i]].of
                values = {k: cut(_flat_block(v)).clone() if _sliced(v) else v
                          for k, v in values.items()}
            if values:
                state[i] = values
        self.inner.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})
        if self.extra is not None:
            self.extra.load(extra)


@dataclasses.dataclass(frozen=True)
class Slice:
    """One replica's part of a parameter's flat local block: `piece` (a view of it, the
    parameter the inner optimizer updates) from element `start`; every replica's part is
    `chunk` long but the last ones."""

    piece: nn.Parameter
    start: int
    chunk: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """The same part of another flat tensor laid out as the parameter (its gradient, a
        state)."""
        return flat[self.start:self.start + self.piece.numel()]


def _rebuilt(optimizer: torch.optim.Optimizer, replace) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class and hyperparameters over other tensors (torch's
    optimizers take their defaults as keywords under other names, so the class is built
    through the base class's constructor)."""
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [replace(p) for p in g["params"]]} for g in optimizer.param_groups]
    rebuilt = type(optimizer).__new__(type(optimizer))
    torch.optim.Optimizer.__init__(rebuilt, groups, dict(optimizer.defaults))
    return rebuilt


def _flat_block(t: torch.Tensor) -> torch.Tensor:
    block = local_block(t).detach()
    if not block.is_contiguous():
        raise UserInputError("layout.optimizer_state: shard_over_data slices every "
                             "parameter's local block flat, and one is not contiguous; use "
                             "like_params")
    return block.view(-1)


def _sliced(value) -> bool:
    """Whether a state value is per element (a slice), not a scalar such as Adam's step."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def laid_out_like(p: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """A local block of `p`'s shape as the tensor `p` is: a DTensor with its placements, or
    itself."""
    block = block.reshape(local_block(p).shape)
    if isinstance(p, DTensor):
        return DTensor.from_local(block, p.device_mesh, p.placements, shape=p.shape,
                                  stride=p.stride())
    return block

