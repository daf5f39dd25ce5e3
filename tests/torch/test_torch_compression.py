"""collectives.compression's quantizers on torch, in one process: each chunk travels as the packed
buffer trainspec.core.packed defines, byte for byte (its float32 arithmetic: the int8 scales
truncated to 17 bits, multiplications by rounded reciprocals, ties to even), and decodes to
what core.packed.unpack reads; the torch implementation passes the conformance suite's
compression families. The exchange over 4 ranks, against JAX's bit for bit, and trajectories:
tests/torch/test_torch_features.py."""
import numpy as np
import pytest
import torch

from trainspec.core import conformance as cases
from trainspec.core import conformance_runner as runner
from trainspec.core import packed
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.compression import decode, encode

FORMATS = [("bf16", 4), ("int8", 4), ("int8", 32), ("int8", 256)]


def _gradient_like(size, scale, seed):
    """Heavy-tailed values over several decades, like a gradient's."""
    rng = np.random.default_rng(seed)
    return (rng.standard_t(3, size) * scale * 10.0 ** rng.uniform(-3, 0, size)).astype(np.float32)


@pytest.mark.parametrize("compression,block", FORMATS)
@pytest.mark.parametrize("size", [1, 7, 301, 1027])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 3e4])
def test_encode_is_core_pack_byte_for_byte(compression, block, size, scale):
    rows = np.stack([_gradient_like(size, scale, seed) for seed in range(3)])
    wire = encode(torch.from_numpy(rows), compression, block).numpy()
    for row, got in zip(rows, wire):
        want = packed.pack(row, compression, block)
        np.testing.assert_array_equal(got, want)
        back = decode(torch.from_numpy(want)[None], compression, block, size)[0].numpy()
        np.testing.assert_array_equal(back.view(np.uint32),
                                      packed.unpack(want, compression, block, size).view(np.uint32))


def test_int8_ties_and_zero_blocks():
    """Half steps round to even, as rint does; an all-zero block has scale 0 and sends 0."""
    scale = (np.float32(127) * packed.INT8_INV_MAX).view(np.uint32) & packed.SCALE_MASK
    scale = np.uint32(scale).view(np.float32)  # the block's scale, absmax 127
    halves = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 0, 0], np.float32) * scale
    x = np.concatenate([[127], halves, np.zeros(8)]).astype(np.float32)
    wire = encode(torch.from_numpy(x)[None], "int8", 8)[0].numpy()
    np.testing.assert_array_equal(wire, packed.pack(x, "int8", 8))
    got = decode(torch.from_numpy(wire)[None], "int8", 8, 16)[0].numpy()
    np.testing.assert_array_equal(got[1:6] / scale, [0, 2, 2, 0, -2])
    assert not got[8:].any()


def test_torch_passes_the_compression_families():
    rows = runner._compression_rows(TorchRuntime())
    n = len(cases.COMPRESSION_FORMATS) * len(cases.COMPRESSION_SIZES)
    assert [(r.family, r.passed, r.failed) for r in rows] == [
        ("compression bounds", n, 0), ("error feedback", n, 0)], rows
