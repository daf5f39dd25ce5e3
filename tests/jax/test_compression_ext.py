"""collectives.compression on the ext backend: the xla_ext packed-buffer handlers
(xla_ext/compression.cc) against the byte layout's NumPy definition (trainspec.core.packed), bit
for bit against the xla path's jnp kernels, in a training step, and how they fail."""
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from trainspec.jax.collectives import compression as jc
from trainspec.jax.collectives import compression_ext as ce
from trainspec.core import packed

FORMATS = [("bf16", 0), ("int8", 4), ("int8", 32), ("int8", 256)]


def _values(size, seed=0):
    """Normal-range float32 over many decades, both signs (no subnormals: NumPy keeps them,
    XLA:CPU flushes them)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(size) * 10.0 ** rng.uniform(-8, 8, size)).astype(np.float32)


@pytest.mark.parametrize("compression,block", FORMATS)
@pytest.mark.parametrize("size", [1, 7, 1000, 1025])
def test_packed_buffer_is_the_documented_byte_layout(compression, block, size):
    x = _values(size, size)
    got = np.asarray(jax.jit(lambda v: ce.quantize(v, compression, block))(x))
    want = packed.pack(x, compression, block)
    np.testing.assert_array_equal(got, want)
    assert got.size == packed.packed_bytes(size, compression, block) and got.size % 4 == 0
    assert got[:4].tobytes() == b"TSQ1"
    back = np.asarray(jax.jit(lambda p: ce.dequantize_sum(p[None], compression, block, size))(got))
    np.testing.assert_array_equal(back, packed.unpack(want, compression, block, size))


def _special_values(replicas, size, block):
    """Per replica: gradient-like values plus what a kernel gets wrong -- exact ties of the int8
    grid (rint's ties to even), values that round to a bf16 tie, zeros, a whole-zero block,
    subnormals (flushed by XLA:CPU and by the handler on the same thread), infinities, NaN."""
    x = np.stack([_values(size, seed) for seed in range(replicas)])
    x[:, :8] = np.float32(127.0) * np.array([1, 0.5 / 127, 1.5 / 127, -2.5 / 127, 3.5 / 127,
                                               -126.5 / 127, 0, -1], np.float32)
    x[:, 8:12] = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130], np.float32)
    x[:, block:2 * block] = 0
    x[1, 2 * block + 1] = np.inf
    x[2, 3 * block + 2] = np.nan
    x[3, 3 * block + 3] = -np.float32(1e-40)
    return x


def _bitwise_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and np.array_equal(a.view(np.uint32)[~nan],
                                                                b.view(np.uint32)[~nan])


@pytest.mark.parametrize("compression,block", [("bf16", 0), ("int8", 32)])
def test_ext_compressed_sum_is_bitwise_the_jnp_one(compression, block):
    """8 replicas: the same total on every replica and the same residuals, bit for bit, from
    the handlers (ext all-gather of packed buffers) and from the jnp kernels (lax all-gather)."""
    mesh = jax.make_mesh((8,), ("data",))
    size = 4 * 32 + 5
    x = _special_values(8, size, 32)
    r = np.stack([_values(size, 100 + i) * np.float32(1e-3) for i in range(8)])

    def run(impl):
        def body(xl, rl):
            total, new_r = impl(xl[0], rl[0], "data", 8, compression, block)
            return total[None], new_r[None]
        split = NamedSharding(mesh, P("data"))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                                     out_specs=(P("data"), P("data")), check_vma=False))(
            jax.device_put(x, split), jax.device_put(r, split))

    (t_ext, r_ext), (t_jnp, r_jnp) = run(ce.compressed_sum), run(jc.compressed_sum)
    t_ext, r_ext = np.asarray(t_ext), np.asarray(r_ext)
    assert all(_bitwise_equal(t_ext[0], t) for t in t_ext)
    assert _bitwise_equal(t_ext, np.asarray(t_jnp)) and _bitwise_equal(r_ext, np.asarray(r_jnp))
    assert np.isnan(t_ext[0]).any() and np.isfinite(t_ext[0]).sum() > size // 2  # cases ran


_TRAINING_CHILD = """
import sys
sys.path[:0] = sys.argv[1:]  # this file's folder, and tests/ for tiny
import jax
import numpy as np
from trainspec.jax.train import build_job
from test_compression_ext import _bitwise_equal
from tiny import tiny_spec

out = {}
for backend in ("xla", "ext"):
    job = build_job(tiny_spec('collectives.compression="int8"', f'collectives.backend="{backend}"',
                              "collectives.compression_block=32", layout="data"))
    state = job.state
    for i in range(2):
        state, _ = job.step(state, job.step.shard_batch(job.data.batch(i)))
    out[backend] = jax.device_get((state.params, state.ef_residual))
paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(out["ext"])]
differ = [p for p, a, b in zip(paths, jax.tree.leaves(out["ext"]), jax.tree.leaves(out["xla"]))
          if not _bitwise_equal(a, b)]
assert not differ, f"not bitwise equal: {differ}"
assert any(np.abs(r).max() > 0 for r in jax.tree.leaves(out["ext"][1]))  # feedback ran
"""


def test_training_steps_on_ext_equal_the_xla_path_bitwise():
    """int8 on 8 replicas, two steps (the second with a non-zero residual): parameters and
    residuals equal bit for bit. (From the second step on, the optimizer's own state can
    differ by an ulp between the two programs: XLA:CPU fuses, and contracts into FMAs, the
    update differently around the custom calls; the reduction is what is compared.)

    Run in a process of its own with XLA's default emitters: with the suite's faster-compiling
    ones (tests/xla_env.py) the two programs compile the jnp code around the compression
    differently, and the residuals differ by ulps after step 1 (the parameters do not)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, "-c", _TRAINING_CHILD, *(str(p) for p in Path(__file__).resolve().parents[:2])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


# -- how the handlers fail: INVALID_ARGUMENT naming the argument, never a crash -------------------

def _call(target, args, outs, **attrs):
    attrs = {"compression": "int8", "block": np.int64(4), **attrs}
    return jax.jit(lambda *a: jax.ffi.ffi_call(f"trainspec_{target}", outs)(*a, **attrs))(*args)


F32_8 = np.arange(8, dtype=np.float32)
U8 = lambda n: jax.ShapeDtypeStruct((n,), jnp.uint8)  # noqa: E731
F32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.float32)  # noqa: E731
GOOD = packed.pack(F32_8, "int8", 4)  # 16 + 2 * (4 + 4) = 32 bytes


def _corrupt(offset, value):
    bad = GOOD.copy()
    bad[offset] = value
    return bad


@pytest.mark.parametrize("target,args,outs,attrs,message", [
    ("quantize", [F32_8.astype(np.int32)], U8(32), {}, "x must be float32"),
    ("quantize", [F32_8], U8(32), {"compression": "fp8"},
     'compression must be "bf16" or "int8", got "fp8"'),
    ("quantize", [F32_8], U8(32), {"block": np.int64(6)}, "block must be a positive multiple of 4"),
    ("quantize", [F32_8], U8(32), {"block": np.int64(0)}, "block must be a positive multiple of 4"),
    ("quantize", [F32_8], U8(32), {"compression": "bf16"}, "block must be 0 for bf16, got 4"),
    ("quantize", [F32_8], U8(31), {}, "packed buffers must be 32 bytes each"),
    ("quantize", [F32_8], jax.ShapeDtypeStruct((32,), jnp.int8), {},
     "packed must be uint8 or int32"),
    ("quantize", [F32_8], jax.ShapeDtypeStruct((32,), jnp.int32), {},
     "packed buffers must be 32 bytes each"),
    ("quantize", [F32_8], U8(64), {}, "packed buffers must be 32 bytes each"),
    ("dequantize", [GOOD], F32(9), {}, "packed buffers must be 40 bytes each"),
    ("dequantize", [GOOD], jax.ShapeDtypeStruct((8,), jnp.int32), {}, "output must be float32"),
    ("dequantize", [_corrupt(0, 0)], F32(8), {},
     r"packed buffer 0 has header \(magic 0x31515300, format 2, elements 8, block 4\), "
     r"expected \(magic 0x31515354, format 2, elements 8, block 4\)"),
    ("dequantize", [np.stack([GOOD, _corrupt(4, 1)])], F32(8), {},
     r"packed buffer 1 has header \(magic 0x31515354, format 1,"),
    ("dequantize", [_corrupt(12, 8)], F32(8), {},
     r"packed buffer 0 has header .*block 8\), expected .*block 4\)"),
    ("error_feedback", [F32_8.astype(np.int32), F32_8], (U8(32), F32(8)), {}, "g must be float32"),
    ("error_feedback", [F32_8, F32_8[:7]], (U8(32), F32(8)), {},
     "residual has 7 elements, expected 8"),
    ("error_feedback", [F32_8, F32_8], (U8(32), F32(9)), {}, "new residual has 9 elements"),
])
def test_bad_calls_are_invalid_argument_naming_what(target, args, outs, attrs, message):
    with pytest.raises(Exception, match=f"INVALID_ARGUMENT: trainspec_{target}: {message}"):
        jax.block_until_ready(_call(target, args, outs, **attrs))
