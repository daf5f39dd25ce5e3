"""The collectives' conformance cases (layouts, (op, shape, kwargs) cases, inputs, expectations)
and the suite's `Row` of results.

Every implementation of the collectives runs the same cases against the same float64
references and tolerances (collectives_reference.py). An implementation's runner builds the
layout's mesh, runs `case.op` over `layout.group` on `inputs(...)` cast to the dtype, and
compares with `expected(...)`; tests/conformance/test_collectives_conformance.py is the JAX one.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable

import numpy as np

from trainspec.core import collectives_reference as ref
from trainspec.core import packed

DTYPES = ["float32", "bfloat16", "float16", "float64", "int32"]


@dataclasses.dataclass
class Row:
    """One family's verdict, a row of the table `trainspec conformance` prints."""

    family: str
    passed: int = 0
    failed: int = 0
    first_failure: str = ""
    skipped: str = ""  # why the family does not apply to the implementation
    refused: list[str] = dataclasses.field(default_factory=list)  # cases its table refuses

    def add(self, ok: bool, what: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            self.first_failure = self.first_failure or what


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    group: tuple[str, ...]  # the axes one collective spans

    @property
    def axis_name(self):
        return self.group[0] if len(self.group) == 1 else self.group

    @property
    def group_dims(self) -> tuple[int, ...]:
        return tuple(self.mesh_axes.index(a) for a in self.group)

    @property
    def n(self) -> int:
        return math.prod(self.mesh_shape[d] for d in self.group_dims)


LAYOUTS = [
    Layout("line8", (8,), ("i",), ("i",)),
    Layout("rows", (2, 4), ("r", "c"), ("c",)),  # 2 groups: each row of 4
    Layout("cols", (2, 4), ("r", "c"), ("r",)),  # 4 groups: each column of 2
    Layout("grid", (2, 4), ("r", "c"), ("r", "c")),  # 1 group of 8, ranked row-major
    # 6 of the 8 devices, groups of 3: a group size that is not a power of two (mean divides
    # inexactly, broadcast trees are ragged) and a program that leaves devices out.
    Layout("rows3", (2, 3), ("r", "c"), ("c",)),
]
# A group whose axes are not in mesh order is still ranked row-major in the tuple's order.
GROUP_ORDER = Layout("grid_rev", (2, 4), ("r", "c"), ("c", "r"))


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of an op; shape and kwargs are functions of the group size n."""

    id: str
    op: str
    shape: Callable[[int], tuple[int, ...]]  # n -> local shape
    kwargs: Callable[[int], dict] = lambda n: {}  # n -> op kwargs

    def resolve(self, n):
        return self.shape(n), self.kwargs(n)

    @property
    def linear(self) -> bool:
        return self.resolve(2)[1].get("op") not in ("max", "min")

    @property
    def needs_float(self) -> bool:
        """Mean of integers is not a case but an error (ILLEGAL_MEAN)."""
        return self.resolve(2)[1].get("op") == "mean"


def _cases():
    # Shapes: a scalar or a single-element-per-member operand (the smallest each op allows), and
    # odd sizes (5, 3) wherever the op does not require divisibility by the group size.
    for red in ref.ALL_REDUCE_OPS:
        yield Case(f"all_reduce-{red}-scalar", "all_reduce", lambda n: (), lambda n, r=red: {"op": r})
        yield Case(f"all_reduce-{red}-5x3", "all_reduce", lambda n: (5, 3), lambda n, r=red: {"op": r})
    for red in ref.REDUCE_SCATTER_OPS:
        yield Case(f"reduce_scatter-{red}-n", "reduce_scatter", lambda n: (n,),
                   lambda n, r=red: {"op": r, "scatter_dimension": 0})
        yield Case(f"reduce_scatter-{red}-3x2n-dim1", "reduce_scatter", lambda n: (3, 2 * n),
                   lambda n, r=red: {"op": r, "scatter_dimension": 1})
    yield Case("all_gather-1", "all_gather", lambda n: (1,), lambda n: {"axis": 0})
    yield Case("all_gather-5x3-axis1", "all_gather", lambda n: (5, 3), lambda n: {"axis": 1})
    yield Case("all_to_all-n", "all_to_all", lambda n: (n,),
               lambda n: {"split_axis": 0, "concat_axis": 0})
    yield Case("all_to_all-3x2n-split1-concat0", "all_to_all", lambda n: (3, 2 * n),
               lambda n: {"split_axis": 1, "concat_axis": 0})
    yield Case("broadcast-scalar-root0", "broadcast", lambda n: (), lambda n: {"root": 0})
    yield Case("broadcast-5x3-rootlast", "broadcast", lambda n: (5, 3), lambda n: {"root": n - 1})
    yield Case("permute-scalar-shift", "permute", lambda n: (),
               lambda n: {"perm": [(i, (i + 1) % n) for i in range(n)]})
    # Only member 0 receives: every other member must get zeros.
    yield Case("permute-5x3-one", "permute", lambda n: (5, 3), lambda n: {"perm": [(n - 1, 0)]})


CASES = list(_cases())
LINEAR_CASES = [c for c in CASES if c.linear]

# Calls every implementation must reject at trace (or call) time, with a ValueError whose
# message matches: (op, local shape as a function of n, kwargs as a function of n, pattern).
ILLEGAL = [
    ("reduce_scatter", lambda n: (n + 1,), lambda n: {}, "not divisible by the group size"),
    ("reduce_scatter", lambda n: (), lambda n: {}, "out of range"),
    ("all_to_all", lambda n: (n + 1,), lambda n: {"split_axis": 0, "concat_axis": 0},
     "not divisible by the group size"),
    ("all_to_all", lambda n: (n,), lambda n: {"split_axis": 0, "concat_axis": 1}, "out of range"),
    ("all_gather", lambda n: (), lambda n: {}, "out of range"),
    ("all_gather", lambda n: (2,), lambda n: {"axis": 1}, "out of range"),
    ("broadcast", lambda n: (2,), lambda n: {"root": n}, "root must be"),
    ("permute", lambda n: (2,), lambda n: {"perm": [(0, 1), (2, 1)]}, "destinations must be unique"),
    ("permute", lambda n: (2,), lambda n: {"perm": [(0, n)]}, "outside"),
    ("all_reduce", lambda n: (2,), lambda n: {"op": "prod"}, "op must be one of"),
    ("reduce_scatter", lambda n: (n,), lambda n: {"op": "max"}, "op must be one of"),
    ("all_reduce", lambda n: (2,), lambda n: {"timeout_s": 0}, "timeout_s must be"),
]
ILLEGAL_MEAN = "needs a floating dtype"  # the message for a mean of integers


def inputs(layout: Layout, local_shape, dtype: str, salt: str) -> np.ndarray:
    """The case's operand over the whole mesh, (*mesh_shape, *local_shape): int32 for "int32",
    else float64 values that the implementation rounds to `dtype` (a seeded normal draw)."""
    rng = np.random.default_rng(zlib.crc32(f"{layout.name}/{salt}".encode()))
    shape = layout.mesh_shape + tuple(local_shape)
    if dtype == "int32":  # small enough that no sum of 8 overflows
        return rng.integers(-1000, 1000, shape).astype(np.int32)
    return rng.standard_normal(shape)


def expected(layout: Layout, case: Case, dtype: str, x: np.ndarray):
    """The float64 (int64) reference result of the case on `x` (the inputs as the implementation
    holds them, already rounded to `dtype`) and the per-element tolerance, in x's mesh layout."""
    kwargs = case.resolve(layout.n)[1]
    wide = x.astype(np.int64 if dtype == "int32" else np.float64)
    blocks, back = ref.to_groups(wide, len(layout.mesh_shape), layout.group_dims)
    result = ref.REFERENCES[case.op](blocks, **kwargs)
    tol = ref.tolerance(case.op, kwargs, dtype, blocks, result)
    return back(result), back(np.broadcast_to(tol, result.shape))


# -- collectives.compression: the quantizers' bounds and the error-feedback identity -----------
COMPRESSION_FORMATS = [("bf16", 0), ("int8", 4), ("int8", 32), ("int8", 256)]
COMPRESSION_SIZES = (1, 7, 1000, 1027)  # one element, a partial block, whole and ragged blocks


def compression_inputs(size: int, salt: str) -> tuple[np.ndarray, np.ndarray]:
    """(float32 gradient-like values: heavy-tailed, both signs, over 8 decades, all in the
    normal range; a residual about 1e-3 of them)."""
    rng = np.random.default_rng(zlib.crc32(salt.encode()))
    x = rng.standard_t(3, size) * 10.0 ** rng.uniform(-4, 4, size)
    return x.astype(np.float32), (x * 1e-3 * rng.standard_normal(size)).astype(np.float32)


def compression_bound(x: np.ndarray, compression: str, block: int) -> np.ndarray:
    """The stated per-element bound on |x - dequantized(quantized(x))| (docs/xla_ext.md), for
    finite float32 x in the normal range: bf16 half an ulp of 8 significant bits, 2^-8 |x|;
    int8 half a step of the block's scale (trainspec/core/packed.py), plus the two float32
    roundings of x * fl(1/scale), (2^-23 + 2^-48) |x|."""
    wide = np.abs(np.asarray(x, np.float64))
    if compression == "bf16":
        return wide * 2.0**-8
    scales = packed.quantize_int8(np.asarray(x, np.float32), block)[0].astype(np.float64)
    return np.repeat(scales / 2, block)[: wide.size] + wide * (2.0**-23 + 2.0**-48)
