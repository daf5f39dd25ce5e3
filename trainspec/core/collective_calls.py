"""Validation of one collective call, framework-free.

Every implementation checks a call with `check_call` before it communicates (the JAX API at
trace time, the torch adapter before touching torch.distributed), so that a bad call fails with
the same ValueError message everywhere: the conformance suite's ILLEGAL cases.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from trainspec.core.collectives_reference import ALL_REDUCE_OPS, REDUCE_SCATTER_OPS


def _axis(name: str, ndim: int, axis, what: str) -> int:
    if not isinstance(axis, numbers.Integral) or not -ndim <= axis < ndim:
        raise ValueError(f"{name}: {what}={axis!r} is out of range for an operand of rank {ndim}")
    return int(axis) % ndim


def _divisible(name: str, shape: Sequence[int], axis, what: str, n: int, axis_name) -> int:
    axis = _axis(name, len(shape), axis, what)
    if shape[axis] % n:
        raise ValueError(f"{name}: operand dimension {axis} ({what}) has size {shape[axis]}, "
                         f"not divisible by the group size {n} of axis {axis_name!r}")
    return axis


def _reduction(name: str, red: str, allowed: tuple[str, ...], dtype: str, is_float: bool) -> None:
    if red not in allowed:
        raise ValueError(f"{name}: op must be one of {allowed}, got {red!r}")
    # A mean of integers would have to change the dtype (lax.pmean returns float32): refused.
    if red == "mean" and not is_float:
        raise ValueError(f"{name}: op='mean' needs a floating dtype, got {dtype}; "
                         "use op='sum' and divide")


def _perm(perm, n: int) -> tuple[tuple[int, int], ...]:
    try:
        perm = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError) as err:
        raise ValueError(f"permute: perm must be (src, dst) pairs of ints, got {perm!r}") from err
    for pair in perm:
        if not all(0 <= r < n for r in pair):
            raise ValueError(f"permute: pair {pair} has a rank outside [0, {n})")
    for side, ranks in (("sources", [s for s, _ in perm]), ("destinations", [d for _, d in perm])):
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"permute: {side} must be unique, got perm={perm}")
    return perm


def check_call(op: str, shape: Sequence[int], dtype: str, is_float: bool, n: int, axis_name,
               kwargs: dict[str, Any]) -> dict[str, Any]:
    """Validate collective `op` on an operand of `shape` and `dtype` in a group of `n` members
    over `axis_name`. Returns the op's arguments normalised (defaults filled in, axes as
    non-negative ints, root an int, perm a tuple of int pairs; `timeout_s` checked and
    dropped). Raises ValueError naming the argument."""
    kw = dict(kwargs)
    timeout = kw.pop("timeout_s", None)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout!r}")
    if op == "all_reduce":
        _reduction(op, kw.setdefault("op", "sum"), ALL_REDUCE_OPS, dtype, is_float)
    elif op == "reduce_scatter":
        _reduction(op, kw.setdefault("op", "sum"), REDUCE_SCATTER_OPS, dtype, is_float)
        kw["scatter_dimension"] = _divisible(op, shape, kw.get("scatter_dimension", 0),
                                             "scatter_dimension", n, axis_name)
    elif op == "all_gather":
        kw["axis"] = _axis(op, len(shape), kw.get("axis", 0), "axis")
    elif op == "all_to_all":
        kw["split_axis"] = _divisible(op, shape, kw["split_axis"], "split_axis", n, axis_name)
        kw["concat_axis"] = _axis(op, len(shape), kw["concat_axis"], "concat_axis")
    elif op == "broadcast":
        root = kw.get("root", 0)
        if not (isinstance(root, numbers.Integral) and 0 <= root < n):
            raise ValueError(f"broadcast: root must be an int in [0, {n}), got {root!r}")
        kw["root"] = int(root)
    elif op == "permute":
        kw["perm"] = _perm(kw["perm"], n)
    else:
        raise ValueError(f"unknown collective {op!r}")
    return kw
