"""The xla_ext reduction kernels give the same bits whichever ISA variant runs.

xla_ext/reduce_kernels.cc is compiled for baseline x86-64, AVX2 and AVX-512 and picks the best
the CPU has, once per process; TRAINSPEC_XLA_EXT_ISA can only lower that choice. Each variant
runs here in its own process over every dtype and reduce op, at a size that takes the
streaming path (outputs >= 1 MiB) with a tail, and at a small size (the last arriver does all
the work). Each process reports the variant that actually ran (`_xla_ext.active_isa()`): the
one asked for, or for a variant the CPU lacks the best one it has (a request only lowers the
choice). Every variant must match a NumPy rank-order reference bit for bit, and so each other.
"""
import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent(r"""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from trainspec.jax import _xla_ext
    from trainspec.jax.collectives import ext

    mesh = Mesh(np.array(jax.devices()), ("d",))
    rng = np.random.default_rng(7)
    DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
              "float64": np.float64, "int32": np.int32}

    def members(dtype, count):
        if dtype is np.int32:
            return rng.integers(-2**31, 2**31 - 1, (8, count), dtype=np.int64).astype(np.int32)
        x = rng.standard_normal((8, count)) * 10.0 ** rng.integers(-3, 4, (8, count))
        if dtype is np.float16:
            x = x / 1e3
        return x.astype(dtype)

    def reference(x, op):
        acc_t = np.float64 if x.dtype == np.float64 else (np.int32 if x.dtype == np.int32
                                                          else np.float32)
        acc = x[0].astype(acc_t)
        for r in range(1, 8):
            v = x[r].astype(acc_t)
            if op in ("sum", "mean"):
                with np.errstate(over="ignore"):
                    acc = acc + v
            else:
                acc = (np.maximum if op == "max" else np.minimum)(acc, v)
        if op == "mean":
            acc = acc / acc_t(8)
        return acc.astype(x.dtype)

    for name, dtype in DTYPES.items():
        for count in (8 * 65536 + 8 * 37, 8 * 13):  # >= 2 MiB per member with a tail; tiny
            x = members(dtype, count)
            ops = ["sum", "max", "min"] + ([] if dtype is np.int32 else ["mean"])
            def body(v):
                v = v[0]
                res = {op: ext.all_reduce(v, "d", op)[None] for op in ops}
                res["rs"] = ext.reduce_scatter(v, "d")[None]
                return res
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                      check_vma=False))
            got = {k: np.asarray(v) for k, v in
                   f(jax.device_put(x, NamedSharding(mesh, P("d")))).items()}
            for op in ops:
                want = reference(x, op)
                for m in range(8):
                    assert got[op][m].tobytes() == want.tobytes(), (name, count, op, m)
            want = reference(x, "sum").reshape(8, -1)
            assert got["rs"].tobytes() == want.tobytes(), (name, count, "reduce_scatter")
    print(json.dumps({"isa": _xla_ext.active_isa()}))
""")


ISAS = ("baseline", "avx2", "avx512")
# /proc/cpuinfo flags each variant needs (reduce_kernels.cc's __builtin_cpu_supports checks).
_FLAGS = {"baseline": set(), "avx2": {"avx2"},
          "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# The variant reduce_kernels.cc's DetectIsa picks on this CPU when nothing lowers it.
BEST = [isa for isa in ISAS if _FLAGS[isa] <= _cpu_flags()][-1]


def _run(isa):
    env = dict(os.environ, TRAINSPEC_XLA_EXT_ISA=isa)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and
                                     platform.machine() in ("x86_64", "AMD64")),
                                reason="the ISA variants are x86-64 Linux kernels")


@pytest.mark.parametrize("isa", ISAS)
def test_variant_runs_when_asked_and_matches_the_rank_order_reference(isa):
    # A variant the CPU lacks must not run (SIGILL): the best one below it runs, named as itself.
    expected = ISAS[min(ISAS.index(isa), ISAS.index(BEST))]
    assert _run(isa)["isa"] == expected  # the child has checked the bits against NumPy
