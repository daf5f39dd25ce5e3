"""The xla_ext kernels on the device jax runs on, against NumPy, and their memory bandwidth.

The GPU check's kernel stage (bench/device_check.sh). On a GPU it runs the CUDA handlers; on a
CPU (`--dry-run`: small sizes) the CPU handlers, so the same code paths are exercised between
lendings (tests/cli/test_device_check.py). Each check compares bit for bit with the NumPy
definitions (trainspec.core.packed, trainspec.core.fingerprint); the ext all-reduce runs on a
one-device mesh, which on a GPU is a one-rank NCCL communicator: the bootstrap, the handler and
the rank-order reduction run, though nothing crosses a link. Bandwidth: the bytes a kernel must
read and write over its best time of `--repeats`, against the HBM peak of the card's profile.

    python bench/gpu_kernels.py --json OUT.json [--mib 256] [--dry-run]

Writes one JSON object per row (name, result, goal, ok) for bench/device_check_table.py.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

# HBM peak per card (datasheets: H100 SXM 3.35 TB/s HBM3, H200 4.8 TB/s HBM3e); the profiles in
# trainspec/core/plan/profiles name the cards the same way.
HBM_PEAK_BPS = {"H100": 3.35e12, "H200": 4.8e12}
BANDWIDTH_GOAL = 0.70
BLOCK = 256


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="file to write the rows to")
    p.add_argument("--mib", type=int, default=256, help="input size of the bandwidth runs")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dry-run", action="store_true", help="1 MiB, 2 repeats: any device")
    return p


def _best_time(fn, *args, repeats: int) -> float:
    fn(*args)[0].block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args)
        out[0].block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def _peak(device) -> float | None:
    return next((bps for card, bps in HBM_PEAK_BPS.items() if card in device.device_kind), None)


def correctness_rows(x: np.ndarray) -> list[dict]:
    """Each kernel family on the device against NumPy, bit for bit."""
    import jax
    import jax.numpy as jnp

    from trainspec.core import packed
    from trainspec.core.fingerprint import fingerprint_reference
    from trainspec.jax.collectives import compression_ext, ext
    from trainspec.jax.fingerprint import fingerprint

    residual = np.full_like(x, 0.25)
    corrected = x + residual
    checks = {}
    for compression in ("int8", "bf16"):
        block = BLOCK if compression == "int8" else 0
        want = packed.pack(x, compression, block)
        got = np.asarray(jax.jit(lambda v: compression_ext.quantize(v, compression, block))(x))
        checks[f"quantize {compression}"] = np.array_equal(got, want)
        summed = jax.jit(lambda p: compression_ext.dequantize_sum(p, compression, block, x.size))
        two = np.stack([want, want])
        checks[f"dequantize-sum {compression}"] = np.array_equal(
            np.asarray(summed(two)), packed.unpack(want, compression, block, x.size) * 2,
            equal_nan=True)
        ef_packed, lost = jax.jit(lambda g, r: compression_ext.error_feedback(
            g, r, compression, block))(x, residual)
        want_ef = packed.pack(corrected, compression, block)
        checks[f"error feedback {compression}"] = (
            np.array_equal(np.asarray(ef_packed), want_ef) and np.array_equal(
                np.asarray(lost), corrected - packed.unpack(want_ef, compression, block, x.size),
                equal_nan=True))
    checks["fingerprint"] = np.array_equal(np.asarray(jax.jit(fingerprint)(x)),
                                           fingerprint_reference(x))
    mesh = jax.make_mesh((1,), ("data",))
    for dtype in (jnp.float32, jnp.bfloat16):
        with jax.set_mesh(mesh):
            reduced = jax.jit(jax.shard_map(lambda v: ext.all_reduce(v, "data", "mean"),
                                            in_specs=jax.P(), out_specs=jax.P(),
                                            check_vma=False))(x.astype(dtype))
        checks[f"ext all_reduce mean {jnp.dtype(dtype).name} (1 rank)"] = np.array_equal(
            np.asarray(reduced), np.asarray(x.astype(dtype)), equal_nan=True)
    return [{"name": f"{name} vs NumPy", "result": "equal" if ok else "DIFFERS",
             "goal": "bit for bit", "ok": bool(ok)} for name, ok in checks.items()]


def bandwidth_rows(n: int, repeats: int) -> list[dict]:
    """int8 quantize and bf16 pack of n float32: read 4n bytes, write the packed buffer."""
    import jax

    from trainspec.core.packed import packed_bytes
    from trainspec.jax.collectives import compression_ext

    device = jax.devices()[0]
    peak = _peak(device)
    x = jax.random.normal(jax.random.key(0), (n,))
    rows = []
    for compression, block in (("int8", BLOCK), ("bf16", 0)):
        fn = jax.jit(lambda v: (compression_ext.quantize(v, compression, block),))
        seconds = _best_time(fn, x, repeats=repeats)
        bps = (4 * n + packed_bytes(n, compression, block)) / seconds
        fraction = bps / peak if peak else None
        rows.append({
            "name": f"pack {compression}, {4 * n >> 20} MiB, {device.device_kind}",
            "result": f"{bps / 1e9:.0f} GB/s" + (f" = {100 * fraction:.0f}% of HBM peak"
                                                 if fraction else " (no HBM peak for this device)"),
            "goal": f">= {100 * BANDWIDTH_GOAL:.0f}% of peak",
            "ok": bool(fraction is not None and fraction >= BANDWIDTH_GOAL)})
    return rows


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    mib, repeats = (1, 2) if args.dry_run else (args.mib, args.repeats)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(100_003) * 3).astype(np.float32)  # odd count: padding paths
    x[[7, 500]] = [np.inf, np.nan]
    rows = correctness_rows(x) + bandwidth_rows(mib << 18, repeats)
    with open(args.json, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    for row in rows:
        print(f"{row['name']}: {row['result']}")
    return 0 if all(r["ok"] for r in rows if "vs NumPy" in r["name"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
