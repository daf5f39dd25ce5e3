"""The collectives' semantics: NumPy references (float64 / int64) of the six ops, their
adjoints, and the tolerances an implementation must meet (docs/collectives.md).

A group's inputs are a block array B of shape (G, n, *local): G independent groups of n members,
member k holding B[:, k]. Each reference returns (G, n, *out_local), member k's result at [:, k].
"""
from __future__ import annotations

import numpy as np

ALL_REDUCE_OPS = ("sum", "mean", "max", "min")
REDUCE_SCATTER_OPS = ("sum", "mean")


def to_groups(x: np.ndarray, mesh_ndim: int, group_dims: tuple[int, ...]):
    """(mesh..., *local) -> (G, n, *local) with members in rank order (row-major over group_dims,
    as lax.axis_index ranks a tuple of axes); returns the blocks and the inverse of the move."""
    other = [d for d in range(mesh_ndim) if d not in group_dims]
    order = other + list(group_dims) + list(range(mesh_ndim, x.ndim))
    moved = x.transpose(order)
    lead = moved.shape[:mesh_ndim]
    n = int(np.prod([x.shape[d] for d in group_dims]))
    blocks = moved.reshape(-1, n, *x.shape[mesh_ndim:])

    def from_groups(b: np.ndarray) -> np.ndarray:
        return b.reshape(*lead, *b.shape[2:]).transpose(np.argsort(order))

    return blocks, from_groups


def _every_member(per_group: np.ndarray, n: int) -> np.ndarray:
    return np.repeat(per_group[:, None], n, axis=1)


def all_reduce(b, op="sum"):
    reduce = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
    return _every_member(reduce(b, axis=1), b.shape[1])


def reduce_scatter(b, scatter_dimension=0, op="sum"):
    total = all_reduce(b, op)[:, 0]
    return np.stack(np.split(total, b.shape[1], axis=1 + scatter_dimension), axis=1)


def all_gather(b, axis=0):
    n = b.shape[1]
    return _every_member(np.concatenate([b[:, j] for j in range(n)], axis=1 + axis), n)


def all_to_all(b, split_axis, concat_axis):
    n = b.shape[1]
    chunks = [np.split(b[:, j], n, axis=1 + split_axis) for j in range(n)]  # chunks[src][dst]
    return np.stack(
        [np.concatenate([chunks[j][k] for j in range(n)], axis=1 + concat_axis) for k in range(n)],
        axis=1,
    )


def broadcast(b, root=0):
    return _every_member(b[:, root], b.shape[1])


def permute(b, perm):
    out = np.zeros_like(b)
    for src, dst in perm:
        out[:, dst] = b[:, src]
    return out


REFERENCES = {f.__name__: f for f in (all_reduce, reduce_scatter, all_gather, all_to_all,
                                      broadcast, permute)}


def adjoint(op: str, kwargs: dict, w: np.ndarray) -> np.ndarray:
    """The transpose of the (linear) op applied to cotangent blocks w: the analytic gradient of
    sum(w * op(x)) with respect to x, written with the forward references above."""
    n = w.shape[1]
    if op == "all_reduce":  # sum: every member's x reaches every output
        return all_reduce(w, kwargs["op"])
    if op == "reduce_scatter":  # x_j's block k reaches member k's output (scaled by 1/n for mean)
        return all_gather(w, kwargs["scatter_dimension"]) / (n if kwargs["op"] == "mean" else 1)
    if op == "all_gather":
        return reduce_scatter(w, kwargs["axis"])
    if op == "all_to_all":
        return all_to_all(w, kwargs["concat_axis"], kwargs["split_axis"])
    if op == "broadcast":  # only root's x reaches the outputs, all of them
        out = np.zeros_like(w)
        out[:, kwargs["root"]] = w.sum(axis=1)
        return out
    if op == "permute":
        return permute(w, [(d, s) for s, d in kwargs["perm"]])
    raise ValueError(op)


# ---- tolerances -------------------------------------------------------------------------------
#
# Exact ops (gather, scatter of data, all_to_all, broadcast, permute, max, min, any integer op):
# 0 ULP; they only move or select values, so any difference is a bug.
#
# Floating sum / mean over n members, compared with the float64 reference of the same (already
# rounded) inputs:  |out - ref| <= gamma_n(u) * sum_j |x_j| + ulp_out(ref)   (/ n for mean), where
#   * gamma_n(u) = n u / (1 - n u) is Higham's bound for summing n terms in ANY order with unit
#     roundoff u (so it does not assume a reduction order, which backends are free to choose);
#     n rather than n-1 also covers the float64 reference's own rounding.
#   * u is that of the accumulation type: 2^-24 for float32 and for bfloat16/float16, which the
#     API requires to accumulate in float32, and 2^-53 for float64.
#   * ulp_out(ref), one unit in the last place of the output dtype at |ref|, covers the final
#     rounding of a float32 accumulator to bfloat16/float16 (half an ULP), the rounding of
#     dividing by n for mean (exact for n a power of two), and an ULP that changes binade.
# For bfloat16/float16 this is "within 1 ULP of the output dtype" unless there is cancellation;
# an implementation that accumulated in 16 bits would be off by several ULPs and fail
# (test_16bit_sums_accumulate_in_f32 makes sure of it with an adversarial input).

UNIT_ROUNDOFF_OF_ACCUMULATOR = {"float32": 2.0**-24, "bfloat16": 2.0**-24, "float16": 2.0**-24,
                                "float64": 2.0**-53}
# Floating formats: (explicit mantissa bits, exponent of the smallest normal), IEEE 754 and
# bfloat16; spelled out so that the reference needs no framework's dtype table.
FLOAT_FORMATS = {"float64": (52, -1022), "float32": (23, -126), "bfloat16": (7, -126),
                 "float16": (10, -14)}


def ulp(dtype: str, value: np.ndarray) -> np.ndarray:
    """One ULP of `dtype` (a name) at |value| (subnormal spacing below the smallest normal)."""
    nmant, min_exp = FLOAT_FORMATS[str(dtype)]
    mag = np.maximum(np.abs(value), np.exp2(min_exp))
    return np.exp2(np.floor(np.log2(mag)) - nmant)


def tolerance(op: str, kwargs: dict, dtype: str, b: np.ndarray, ref: np.ndarray):
    """Per-element absolute tolerance for `op` on blocks b (0 where the op must be exact)."""
    dtype = str(dtype)
    redop = kwargs.get("op", "sum")
    if dtype not in FLOAT_FORMATS or op not in ("all_reduce", "reduce_scatter") \
            or redop in ("max", "min"):
        return 0.0
    n = b.shape[1]
    nu = n * UNIT_ROUNDOFF_OF_ACCUMULATOR[dtype]
    abs_sum = reduce_scatter(np.abs(b), kwargs["scatter_dimension"]) if op == "reduce_scatter" \
        else all_reduce(np.abs(b))
    return nu / (1 - nu) * abs_sum / (n if redop == "mean" else 1) + ulp(dtype, ref)
