"""Reference sums and the error bound each summation algorithm guarantees (doctor's self-test).

The reference is exact: `math.fsum` of the inputs as float64 (the inputs are first rounded to
the tested dtype, so only the reduction's own error is measured), correctly rounded. A sum of n
terms computed in a working precision with unit roundoff u = eps/2 has |error| <= g * u * sum|x|
(to first order), where g is the depth of the summation tree: n - 1 for a sequential loop,
ceil(log2 n) for a pairwise (tree) reduction (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., section 4.2). Rounding the result to an output dtype adds u_out * |sum|.
XLA reduces 16-bit floats in float32 and rounds the result (checked by the self-test's own
pass on a healthy machine), so the working precision of every float reduction here is float32
or wider.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")  # the float dtypes the self-test checks
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
ALGORITHMS = ("sequential", "pairwise")


def reference_sum(x: np.ndarray) -> float:
    return math.fsum(np.asarray(x, dtype=np.float64).ravel().tolist())


def depth(algorithm: str, n: int) -> int:
    if algorithm == "sequential":
        return max(n - 1, 0)
    if algorithm == "pairwise":
        return math.ceil(math.log2(n)) if n > 1 else 0
    raise ValueError(f"unknown summation algorithm {algorithm!r}; one of {ALGORITHMS}")


def sum_error_bound(x: np.ndarray, algorithm: str, working: str, output: str,
                    n: int | None = None) -> float:
    """Largest |computed - exact| the algorithm allows for summing x (n terms, default x.size)."""
    x64 = np.asarray(x, dtype=np.float64)
    n = x64.size if n is None else n
    exact = abs(reference_sum(x64))
    return (depth(algorithm, n) * EPS[working] / 2 * float(np.abs(x64).sum())
            + EPS[output] / 2 * exact + np.finfo(np.float64).tiny)


@dataclasses.dataclass(frozen=True)
class Result:
    """One comparison: the error against the reference and the bound it must stay within."""

    check: str
    device: int | None
    error: float
    bound: float

    @property
    def ok(self) -> bool:
        return bool(self.error <= self.bound)  # NaN fails


def matmul_error_bound(a: np.ndarray, b: np.ndarray, working: str, output: str) -> np.ndarray:
    """Per element of a @ b: a dot product of k terms, each product rounded in the working
    precision, summed in whatever order the library's kernel picks: k u |a||b| + u_out |a b|.
    The order is the kernel's, so the bound is the one every order meets, the sequential one:
    torch's float32 CPU kernel (AVX-512) can sum k = 255 terms with an error above the
    pairwise (tree) bound and within this one. A
    dropped or doubled term still moves an element by at least 0.25 (every input lies in
    [0.5, 1.5)), 67x this bound at the self-tests' k = 255."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    k = a64.shape[-1]
    return ((depth("sequential", k) + 1) * EPS[working] / 2 * (np.abs(a64) @ np.abs(b64))
            + EPS[output] / 2 * np.abs(a64 @ b64) + np.finfo(np.float64).tiny)


SUM_SCALE = 1000.0  # inputs are scaled so every sum stays near this: float16 overflows at 65504


def numpy_rounding(x: np.ndarray, dtype: str) -> np.ndarray:
    """`x` rounded to `dtype` by NumPy (bfloat16 through ml_dtypes, which jax brings)."""
    import ml_dtypes  # not a dependency of the torch path, which rounds through torch

    kinds = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    return x.astype(kinds[dtype])


def selftest_inputs(shape, dtype: str, seed: int, rounding=numpy_rounding) -> np.ndarray:
    """Positive values in [0.5, 1.5) x min(1, 1000 / n), rounded to `dtype` (`rounding(x,
    dtype)`) and returned as float64: a dropped element moves a sum by a share 1/n of it, far
    above the rounding bounds, and the reference sees exactly the values the device sums."""
    scale = min(1.0, SUM_SCALE / shape[-1])
    x = np.random.default_rng(seed).uniform(0.5, 1.5, shape) * scale
    return np.asarray(rounding(x, dtype)).astype(np.float64)
