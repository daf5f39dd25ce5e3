"""A torch state's bytes in a checkpoint directory and back, with no pickle anywhere: the torch
backend's narrow part of the trunk's store (trainspec.core.store decides everything else).

A state is a nested dict (and list) of tensors, DTensors and plain values (an optimizer's
param_groups). Each rank writes one safetensors file, `rank-<r>.safetensors`, holding the
blocks it is the first holder of: a tensor's block is named by JSON `[path, offsets]` (its
place in the state and in the whole tensor), so that a block held alike by several ranks (a
replicated parameter, a data-parallel copy) is written once. The plain values a rank holds go
into its file's header as JSON. Reading parses only safetensors headers and JSON: a target
state (laid out for the current mesh) takes from each saved block the part that overlaps its
own block, so a checkpoint restores onto another world size or layout.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainspec.core.errors import UserInputError
from trainspec.core.store import BadCheckpoint, first_line

SUFFIX = ".safetensors"
_VALUES = "trainspec.values"  # the header entry holding a file's plain values
_PLAIN = (bool, int, float, str, type(None))


def file_name(rank: int) -> str:
    return f"rank-{rank:05d}{SUFFIX}"


def _leaves(tree, path=()):
    """(path, leaf) of every leaf under dicts and lists, in order."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _leaves(value, (*path, i))
    else:
        yield path, tree


def _block(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's block of `t` and its offsets in the whole tensor."""
    if isinstance(t, DTensor):
        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(int(o) for o in offsets)
    return t, (0,) * t.dim()


def _plain(value, path) -> Any:
    if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(
            isinstance(v, _PLAIN) for v in value)):
        return value
    raise UserInputError(f"checkpoint: the state's {'/'.join(map(str, path))} is a "
                         f"{type(value).__name__}, which is neither a tensor nor a plain value "
                         "a checkpoint can hold without pickle")


class Staged:
    """The blocks this rank writes, copied off the live state (the step may change it in
    place while a background save writes), and its plain values."""

    def __init__(self, blocks: dict[str, torch.Tensor], values: dict[str, Any]):
        self.blocks, self.values = blocks, values

    def write(self, directory: Path, rank: int) -> None:
        save_file(self.blocks, Path(directory) / file_name(rank),
                  metadata={_VALUES: json.dumps(self.values)})


def stage(state: dict, rank: int, gather: Callable[[list], list[list]]) -> Staged:
    """Rank `rank`'s part of `state`. `gather(mine)`: every rank's list, by rank (an all-gather
    of the blocks' names, so that the first rank holding a block writes it)."""
    blocks, values = {}, {}
    for path, leaf in _leaves(state):
        key = json.dumps(list(path))
        if isinstance(leaf, torch.Tensor):
            block, offsets = _block(leaf)
            blocks[json.dumps([key, offsets])] = block
        else:
            values[key] = _plain(leaf, path)
    written_before = {name for names in gather(sorted(blocks))[:rank] for name in names}
    with torch.no_grad():
        mine = {name: block.detach().to("cpu", copy=True).contiguous()
                for name, block in blocks.items() if name not in written_before}
    return Staged(mine, values)


def _saved(files: dict):
    """Every saved block by path: (open file, name, offsets, shape); and the plain values."""
    blocks: dict[str, list] = {}
    values: dict[str, Any] = {}
    for f in files.values():
        for name in f.keys():
            key, offsets = json.loads(name)
            blocks.setdefault(key, []).append(
                (f, name, tuple(offsets), tuple(f.get_slice(name).get_shape())))
        for key, value in json.loads((f.metadata() or {}).get(_VALUES, "{}")).items():
            values.setdefault(key, value)
    return blocks, values


def read(directory: Path, names: list[str], target: dict) -> None:
    """Fill `target` (this rank's state, laid out as it trains now) from the files `names` in
    `directory`; BadCheckpoint when they do not cover it."""
    try:
        with contextlib.ExitStack() as stack:
            files = {n: stack.enter_context(safe_open(Path(directory) / n, framework="pt"))
                     for n in sorted(names) if n.endswith(SUFFIX)}
            _read(files, target)
    except (SafetensorError, OSError, ValueError, TypeError, KeyError) as err:
        raise BadCheckpoint(f"its state does not read back ({first_line(err)})") from None


def _read(files: dict, target: dict) -> None:
    saved, values = _saved(files)
    with torch.no_grad():
        for path, leaf in list(_leaves(target)):
            key = json.dumps(list(path))
            if isinstance(leaf, torch.Tensor):
                _fill(saved.get(key, []), leaf, path)
            elif key in values:
                _put(target, path, tuple(values[key]) if isinstance(leaf, tuple) else values[key])


def _fill(blocks: list, leaf: torch.Tensor, path) -> None:
    """Copy into this rank's block of `leaf` every overlap with the saved `blocks`."""
    local, offsets = _block(leaf)
    covered = 0
    for f, name, at, shape in blocks:
        lo = [max(a, o) for a, o in zip(at, offsets)]
        hi = [min(a + s, o + n) for a, s, o, n in zip(at, shape, offsets, local.shape)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        part = f.get_slice(name)[tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, at))] \
            if shape else f.get_tensor(name)
        local[tuple(slice(a - o, c - o) for a, c, o in zip(lo, hi, offsets))].copy_(part)
        covered += part.numel()
    if covered != local.numel():
        raise BadCheckpoint(f"its state covers {covered} of the {local.numel()} elements of "
                            f"{'/'.join(map(str, path))} on this rank")


def _put(tree, path, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value
