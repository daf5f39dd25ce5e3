"""The default job's data: the Python standard library's own source, read as bytes.

It needs no download and is the same on every machine with the same Python. Batches are a
pure function of (seed, step): any process can compute exactly its own shard of any step, which
is what resuming on another device count, or on several hosts, needs; and every implementation
(any framework) trains on the same data order.
"""
from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import numpy as np

CORPUS_BYTES = 4 * 1024 * 1024


@functools.lru_cache(maxsize=2)
def stdlib_corpus(max_bytes: int = CORPUS_BYTES, skip: int = 0) -> np.ndarray:
    """uint8 array of concatenated stdlib `.py` files in sorted path order (deterministic),
    from byte `skip` on."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= skip + max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[skip:skip + max_bytes], dtype=np.uint8)


def held_out_corpus() -> np.ndarray:
    """The stdlib's source past the training corpus: text no step of the default job reads."""
    return stdlib_corpus(CORPUS_BYTES, skip=CORPUS_BYTES)


class ByteBatches:
    """Windows of `seq_len + 1` bytes at random offsets; batch `step` is a pure function of it.

    `batch(step)` returns {"inputs", "targets", "mask"} of shape (global_batch, seq_len); with
    `rows` (a slice) only those rows are built, so a process builds just its shard.
    """

    def __init__(self, seq_len: int, global_batch: int, seed: int, corpus: np.ndarray | None = None):
        self.corpus = stdlib_corpus() if corpus is None else corpus
        if self.corpus.size <= seq_len + 1:
            raise ValueError(f"corpus of {self.corpus.size} bytes is shorter than seq_len {seq_len}")
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed

    def host_bytes(self, rows: int) -> int:
        """Peak host memory of building `rows` rows of a batch: the start offsets of the whole
        batch, the gather's int64 indices and uint8 bytes, the int32 windows, the float32 mask."""
        return 8 * self.global_batch + rows * ((self.seq_len + 1) * (8 + 1 + 4) + 4 * self.seq_len)

    def batch(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.corpus.size - self.seq_len - 1, self.global_batch)[rows]
        windows = self.corpus[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return {
            "inputs": windows[:, :-1],
            "targets": windows[:, 1:],
            "mask": np.ones((len(starts), self.seq_len), np.float32),
        }
