"""The replica fingerprint's definition: a bit-exact, order-independent checksum of an array's
bytes, as two uint32 words. Every implementation's fingerprint (the xla_ext custom call for
JAX, the torch adapter's) must equal `fingerprint_reference` of the same bytes bit for bit
(xla_ext/fingerprint.cc says why the sum makes it order-independent). Framework-free.
"""
from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def fingerprint_reference(x) -> np.ndarray:
    """NumPy reference of `fingerprint`: uint32[2] for the C-order bytes of `x`."""
    raw = np.ascontiguousarray(np.asarray(x)).view(np.uint8).reshape(-1)
    nbytes = raw.size
    padded = np.zeros(-(-nbytes // 8) * 8, np.uint8)
    padded[:nbytes] = raw
    words = padded.view("<u8")
    index = np.arange(1, words.size + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        total = np.sum(_mix64(words ^ (index * _GOLDEN)), dtype=np.uint64)
        h = _mix64(np.atleast_1d(total ^ _mix64(np.atleast_1d(np.uint64(nbytes) + _GOLDEN))))[0]
    return np.array([h & np.uint64(0xFFFFFFFF), h >> np.uint64(32)], dtype=np.uint32)
