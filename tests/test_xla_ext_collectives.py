"""The xla_ext collective handlers (spec_jax.collectives.ext) on 8 simulated CPU devices.

Every op is checked against a NumPy reference and against the lax collective, over one mesh
axis and over rows/columns of a 2x4 mesh. The reductions are checked bit for bit against a
float32 sum in rank order (the handler's documented order), so determinism is a property of
the definition, not only of repeated runs. To keep the file fast, each (dtype, layout) is one
compiled program that runs all ops at once (see `_results`).
"""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spec_jax.collectives import ext
from spec_jax.core.topology import transparent_huge_pages

DEVICES = np.array(jax.devices())
MESH_1D = Mesh(DEVICES, ("d",))
MESH_2D = Mesh(DEVICES.reshape(2, 4), ("x", "y"))

# layout name -> (mesh, axis_name of the group, the groups as lists of member indices in rank
# order, where a member index is the flat position in the mesh).
LAYOUTS = {
    "1d": (MESH_1D, "d", [list(range(8))]),
    "rows": (MESH_2D, "y", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    "columns": (MESH_2D, "x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    "both_axes": (MESH_2D, ("x", "y"), [list(range(8))]),
}
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "i32": np.int32}
LOCAL_SHAPE = (8, 16)  # every dimension divisible by every group size above

def _members(dtype, seed: int = 0):
    """Per-member inputs, shape (8, *LOCAL_SHAPE); wide magnitudes so sum order matters."""
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        return rng.integers(-1000, 1000, (8, *LOCAL_SHAPE)).astype(np.int32)
    x = rng.standard_normal((8, *LOCAL_SHAPE)) * 10.0 ** rng.integers(-3, 4, (8, *LOCAL_SHAPE))
    return x.astype(dtype)


def _shard_map(fn, mesh):
    """fn maps one member's local array to a dict of local arrays; run it on every member."""
    spec = P(*mesh.axis_names)
    lead = len(mesh.axis_names)

    def body(block):
        out = fn(block.reshape(block.shape[lead:]))
        return jax.tree.map(lambda a: a.reshape((1,) * lead + a.shape), out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


def _place(members, mesh):
    x = members.reshape(mesh.devices.shape + members.shape[1:])
    return jax.device_put(x, NamedSharding(mesh, P(*mesh.axis_names)))


def _per_member(out, mesh):
    return {k: np.asarray(v).reshape((8,) + v.shape[len(mesh.axis_names):])
            for k, v in out.items()}


# The op set as (ext call, lax call); every entry runs in one program per parametrisation.
def _ops(axis, n, floating):
    perm = [(i, i + 1) for i in range(n - 1)]  # rank 0 receives nothing -> zeros
    ops = {
        "all_reduce_sum": (lambda v: ext.all_reduce(v, axis), lambda v: lax.psum(v, axis)),
        "all_reduce_max": (lambda v: ext.all_reduce(v, axis, "max"), lambda v: lax.pmax(v, axis)),
        "all_reduce_min": (lambda v: ext.all_reduce(v, axis, "min"), lambda v: lax.pmin(v, axis)),
        "reduce_scatter_0": (lambda v: ext.reduce_scatter(v, axis),
                             lambda v: lax.psum_scatter(v, axis, tiled=True)),
        "reduce_scatter_1": (lambda v: ext.reduce_scatter(v, axis, scatter_dimension=1),
                             lambda v: lax.psum_scatter(v, axis, scatter_dimension=1, tiled=True)),
        "all_gather_0": (lambda v: ext.all_gather(v, axis),
                         lambda v: lax.all_gather(v, axis, tiled=True)),
        "all_gather_1": (lambda v: ext.all_gather(v, axis, axis=1),
                         lambda v: lax.all_gather(v, axis, axis=1, tiled=True)),
        "all_to_all_1_0": (lambda v: ext.all_to_all(v, axis, 1, 0),
                           lambda v: lax.all_to_all(v, axis, 1, 0, tiled=True)),
        "all_to_all_0_1": (lambda v: ext.all_to_all(v, axis, 0, 1),
                           lambda v: lax.all_to_all(v, axis, 0, 1, tiled=True)),
        "broadcast": (lambda v: ext.broadcast(v, axis, n - 1), None),
        "permute": (lambda v: ext.permute(v, axis, perm), lambda v: lax.ppermute(v, axis, perm)),
    }
    if floating:
        ops["all_reduce_mean"] = (lambda v: ext.all_reduce(v, axis, "mean"),
                                  lambda v: lax.pmean(v, axis))
    return ops


@functools.lru_cache(maxsize=None)
def _results(dtype_name, layout):
    """(inputs, ext outputs, lax outputs) per member for every op: two compiles in all."""
    dtype = DTYPES[dtype_name]
    mesh, axis, groups = LAYOUTS[layout]
    members = _members(dtype)
    ops = _ops(axis, len(groups[0]), dtype != np.int32)
    x = _place(members, mesh)
    got = _per_member(_shard_map(lambda v: {k: e(v) for k, (e, _) in ops.items()}, mesh)(x), mesh)
    want = _per_member(_shard_map(
        lambda v: {k: l(v) for k, (_, l) in ops.items() if l is not None}, mesh)(x), mesh)
    return members, got, want


# ---- NumPy references ---------------------------------------------------------------------------


def _rank_order_sum(xs):
    """The handler's definition: accumulate in rank order, float32 for 16/32-bit floats."""
    acc_dtype = np.int64 if xs[0].dtype == np.int32 else np.float32
    acc = xs[0].astype(acc_dtype)
    for v in xs[1:]:
        acc = acc + v.astype(acc_dtype)
    return acc.astype(xs[0].dtype)


def _reference(op, xs, rank):
    """Expected output of member `rank` of a group whose inputs are xs (rank order), float64."""
    n = len(xs)
    x64 = [v.astype(np.float64) for v in xs]
    if op == "all_reduce_sum":
        return sum(x64)
    if op == "all_reduce_mean":
        return sum(x64) / n
    if op == "all_reduce_max":
        return np.max(x64, axis=0)
    if op == "all_reduce_min":
        return np.min(x64, axis=0)
    if op.startswith("reduce_scatter_"):
        d = int(op[-1])
        return np.split(sum(x64), n, axis=d)[rank]
    if op.startswith("all_gather_"):
        return np.concatenate(x64, axis=int(op[-1]))
    if op.startswith("all_to_all_"):
        split, concat = int(op[-3]), int(op[-1])
        return np.concatenate([np.split(v, n, axis=split)[rank] for v in x64], axis=concat)
    if op == "broadcast":
        return x64[n - 1]
    if op == "permute":
        return np.zeros_like(x64[0]) if rank == 0 else x64[rank - 1]
    raise AssertionError(op)


EXACT_OPS = ("all_reduce_max", "all_reduce_min", "all_gather_0", "all_gather_1",
             "all_to_all_1_0", "all_to_all_0_1", "broadcast", "permute")
OP_NAMES = list(_ops("d", 8, True))


def _cases():
    for op in OP_NAMES:
        for dtype_name in DTYPES:
            if not (op == "all_reduce_mean" and dtype_name == "i32"):
                yield op, dtype_name, "1d"
        for layout in ("rows", "columns", "both_axes"):
            yield op, "f32", layout


@pytest.mark.parametrize("op,dtype_name,layout", list(_cases()))
def test_matches_numpy_reference(op, dtype_name, layout):
    members, got, _ = _results(dtype_name, layout)
    _, _, groups = LAYOUTS[layout]
    for group in groups:
        xs = [members[m] for m in group]
        for rank, m in enumerate(group):
            out = got[op][m]
            assert out.dtype == members.dtype
            expected = _reference(op, xs, rank)
            if op in EXACT_OPS or dtype_name == "i32":
                np.testing.assert_array_equal(out.astype(np.float64), expected)
            elif op in ("all_reduce_sum", "reduce_scatter_0", "reduce_scatter_1"):
                # Bit for bit the rank-order float32 sum, rounded once to the storage dtype.
                exact = _rank_order_sum(xs)
                if op != "all_reduce_sum":
                    exact = np.split(exact, len(xs), axis=int(op[-1]))[rank]
                np.testing.assert_array_equal(out.view(np.uint8), exact.view(np.uint8))
                tol = 1e-2 if dtype_name == "bf16" else 1e-5
                np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tol,
                                           atol=tol * np.abs(xs).max())
            else:  # mean
                tol = 1e-2 if dtype_name == "bf16" else 1e-5
                np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tol,
                                           atol=tol * np.abs(xs).max())


@pytest.mark.parametrize("op,dtype_name,layout", [
    c for c in _cases() if c[0] != "broadcast"])
def test_matches_lax(op, dtype_name, layout):
    _, got, want = _results(dtype_name, layout)
    if op in EXACT_OPS or dtype_name == "i32":
        np.testing.assert_array_equal(got[op], want[op])
    else:
        # lax sums bf16 in its own order/precision; ext rounds a float32 sum once.
        tol = 2e-2 if dtype_name == "bf16" else 1e-5
        scale = np.abs(want[op].astype(np.float64)).max()
        np.testing.assert_allclose(got[op].astype(np.float64), want[op].astype(np.float64),
                                   rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_all_reduce_float16_and_float64(dtype):
    with jax.enable_x64(dtype == np.float64):
        members = _members(dtype)
        f = _shard_map(lambda v: {"sum": ext.all_reduce(v, "d"),
                                  "max": ext.all_reduce(v, "d", "max")}, MESH_1D)
        got = _per_member(f(_place(members, MESH_1D)), MESH_1D)
    exact = _rank_order_sum(list(members)) if dtype == np.float16 else None
    for m in range(8):
        assert got["sum"][m].dtype == dtype
        np.testing.assert_array_equal(got["max"][m], members.max(axis=0))
        if dtype == np.float16:  # accumulated in float32, rounded once
            np.testing.assert_array_equal(got["sum"][m], exact)
        else:
            acc = members[0].copy()
            for v in members[1:]:
                acc = acc + v
            np.testing.assert_array_equal(got["sum"][m], acc)


# ---- in place -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_in_place_all_reduce_equals_the_out_of_place_one_bit_for_bit(dtype_name):
    """In place, the result overwrites the input buffer while the other members still read
    theirs: every op gives the same bits as out of place (the same kernel, the same order)."""
    members = _members(DTYPES[dtype_name])
    ops = ("sum", "max", "min") + (("mean",) if dtype_name != "i32" else ())
    x = _place(members, MESH_1D)
    out = _shard_map(lambda v: {op: ext.all_reduce(v, "d", op) for op in ops}, MESH_1D)(x)
    inplace = _shard_map(lambda v: {op: ext.all_reduce(v + 0, "d", op, in_place=True)
                                    for op in ops}, MESH_1D)(x)
    for op in ops:
        np.testing.assert_array_equal(np.asarray(inplace[op]).view(np.uint8),
                                      np.asarray(out[op]).view(np.uint8), err_msg=op)


def test_in_place_all_reduce_takes_a_donated_input_buffer_and_leaves_a_live_one_intact():
    spec = P("d")
    x = _place(_members(np.float32), MESH_1D)
    want = _rank_order_sum(list(_members(np.float32)))
    reduce = jax.shard_map(lambda v: ext.all_reduce(v, "d", in_place=True), mesh=MESH_1D,
                           in_specs=spec, out_specs=spec, check_vma=False)
    donated = jax.jit(reduce, donate_argnums=0)
    hlo = donated.lower(x).compile().as_text()
    assert "input_output_alias={ {}: (0, {}, may-alias) }" in hlo and " copy(" not in hlo, hlo
    mine = x + 0
    pointers = [s.data.unsafe_buffer_pointer() for s in mine.addressable_shards]
    got = donated(mine)
    assert [s.data.unsafe_buffer_pointer() for s in got.addressable_shards] == pointers
    for m in range(8):
        np.testing.assert_array_equal(np.asarray(got)[m], want)
    # Used again after the call, the input is copied first and keeps its values.
    both = jax.jit(jax.shard_map(lambda v: (ext.all_reduce(v, "d", in_place=True), v * 1),
                                 mesh=MESH_1D, in_specs=spec, out_specs=(spec, spec),
                                 check_vma=False))
    summed, again = both(x)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(summed), np.asarray(got))


# ---- determinism --------------------------------------------------------------------------------


def test_bitwise_deterministic_whatever_the_arrival_order():
    """20 runs, each delaying a different member so that members arrive in different orders."""
    members = _members(np.float32)

    def body(v, slow_rank):
        rank = lax.axis_index("d")
        # A rank-dependent busy loop: the slow member arrives last.
        spin = lax.fori_loop(0, jnp.where(rank == slow_rank, 20000, 0),
                             lambda i, a: a * 1.0000001 + 1e-9, jnp.float32(0))
        v = v + spin * 0.0
        return {"sum": ext.all_reduce(v, "d"), "rs": ext.reduce_scatter(v, "d")}

    f = jax.jit(jax.shard_map(
        lambda b, s: jax.tree.map(lambda a: a[None], body(b[0], s)),
        mesh=MESH_1D, in_specs=(P("d"), P()), out_specs=P("d"), check_vma=False))
    x = _place(members, MESH_1D)
    runs = [jax.tree.map(np.asarray, f(x, jnp.int32(i % 8))) for i in range(20)]
    exact = _rank_order_sum(list(members))
    for r in runs:
        for m in range(8):
            np.testing.assert_array_equal(r["sum"][m].view(np.uint32), exact.view(np.uint32))
        np.testing.assert_array_equal(r["rs"].view(np.uint32), runs[0]["rs"].view(np.uint32))


# ---- state ----------------------------------------------------------------------------------


def test_no_state_leaks_across_thousands_of_calls():
    x = _place(np.ones((8, 4), np.float32), MESH_1D)

    def body(v):
        # 2000 invocations of one call site: the per-slot invocation counter at work.
        return {"v": lax.fori_loop(0, 2000, lambda i, c: ext.all_reduce(c, "d", "mean") + 1.0, v)}

    out = _per_member(_shard_map(body, MESH_1D)(x), MESH_1D)
    np.testing.assert_array_equal(out["v"][0], np.full(4, 2001.0, np.float32))
    # Separate executions too. Each is awaited: the CPU client deadlocks blocking collectives
    # (lax's included) when many executions are dispatched ahead, see docs/xla_ext.md.
    f = _shard_map(lambda v: {"g": ext.all_gather(v, "d")}, MESH_1D)
    for _ in range(100):
        jax.block_until_ready(f(x))
    assert ext.live_rendezvous_count() == 0


# ---- ordering -----------------------------------------------------------------------------------


def test_independent_collectives_and_scan_do_not_deadlock():
    """Several collectives with no data dependency between them (which the CPU runtime may run
    in any order, see docs/xla_ext.md) plus collectives inside a scan, against lax."""
    def program(ar, ag, perm):
        def body(v):
            a = ar(v * 2.0)
            b = ag(v[:3])
            c = perm(v + 1.0)

            def step(carry, _):
                return ar(carry) * 0.125 + ag(carry[:1]).sum(), None

            d = lax.scan(step, v, None, length=10)[0]
            return {"a": a, "b": b, "c": c, "d": d}
        return _shard_map(body, MESH_1D)

    shift = [(i, (i + 3) % 8) for i in range(8)]
    f_ext = program(lambda v: ext.all_reduce(v, "d", timeout_s=10),
                    lambda v: ext.all_gather(v, "d", timeout_s=10),
                    lambda v: ext.permute(v, "d", shift, timeout_s=10))
    f_lax = program(lambda v: lax.psum(v, "d"), lambda v: lax.all_gather(v, "d", tiled=True),
                    lambda v: lax.ppermute(v, "d", shift))
    x = _place(np.random.default_rng(1).integers(-8, 8, (8, 16)).astype(np.float32), MESH_1D)  # exact in any order
    want = jax.tree.map(np.asarray, f_lax(x))
    for _ in range(30):
        got = jax.tree.map(np.asarray, f_ext(x))
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert ext.live_rendezvous_count() == 0


# ---- transformations ----------------------------------------------------------------------------


GRAD_OPS = {
    "all_reduce_sum": (lambda v: ext.all_reduce(v, "d"), lambda v: lax.psum(v, "d")),
    "all_reduce_mean": (lambda v: ext.all_reduce(v, "d", "mean"), lambda v: lax.pmean(v, "d")),
    # in place, the cotangent is reduced in place too
    "all_reduce_in_place": (lambda v: ext.all_reduce(v * 1, "d", in_place=True),
                            lambda v: lax.psum(v, "d")),
    "reduce_scatter": (lambda v: ext.reduce_scatter(v, "d", scatter_dimension=1),
                       lambda v: lax.psum_scatter(v, "d", scatter_dimension=1, tiled=True)),
    "reduce_scatter_mean": (
        lambda v: ext.reduce_scatter(v, "d", op="mean"),
        lambda v: lax.psum_scatter(v, "d", tiled=True) / 8),
    "all_gather": (lambda v: ext.all_gather(v, "d", axis=1),
                   lambda v: lax.all_gather(v, "d", axis=1, tiled=True)),
    "all_to_all": (lambda v: ext.all_to_all(v, "d", 0, 1),
                   lambda v: lax.all_to_all(v, "d", 0, 1, tiled=True)),
    "permute": (lambda v: ext.permute(v, "d", [(i, (i + 1) % 8) for i in range(7)]),
                lambda v: lax.ppermute(v, "d", [(i, (i + 1) % 8) for i in range(7)])),
    "broadcast": (lambda v: ext.broadcast(v, "d", 2),
                  lambda v: lax.psum(jnp.where(lax.axis_index("d") == 2, v, 0.0), "d")),
}


@pytest.mark.parametrize("op", GRAD_OPS)
def test_grad_matches_lax(op):
    ext_op, lax_op = GRAD_OPS[op]
    members = np.random.default_rng(2).integers(-4, 5, (8, 8, 16)).astype(np.float32)  # exact sums in any order

    def grads(collective):
        def loss(v):
            y = collective(v)
            w = jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) + lax.axis_index("d")
            return jnp.sum(y * w)
        return _shard_map(jax.grad(loss), MESH_1D)

    x = _place(members, MESH_1D)
    np.testing.assert_array_equal(np.asarray(grads(ext_op)(x)), np.asarray(grads(lax_op)(x)))


def test_max_is_not_differentiable():
    with pytest.raises(ValueError, match="not differentiable"):
        _shard_map(jax.grad(lambda v: ext.all_reduce(v, "d", "max").sum()), MESH_1D).lower(
            _place(np.ones((8, 4), np.float32), MESH_1D))


def test_vmap_runs_one_collective_per_batch_element():
    members = np.random.default_rng(3).integers(-4, 5, (8, 3, 16)).astype(np.float32)

    def body(ar, ag):
        return lambda v: {"ar": jax.vmap(ar)(v), "ag": jax.vmap(ag)(v)}

    x = _place(members, MESH_1D)
    got = _per_member(_shard_map(body(lambda r: ext.all_reduce(r, "d"),
                                      lambda r: ext.all_gather(r, "d")), MESH_1D)(x), MESH_1D)
    want = _per_member(_shard_map(body(lambda r: lax.psum(r, "d"),
                                       lambda r: lax.all_gather(r, "d", tiled=True)),
                                  MESH_1D)(x), MESH_1D)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def _mapping_flags(address: int, nbytes: int) -> list[set[str]]:
    """The kernel's VmFlags of each mapping of this process that overlaps [address, +nbytes)."""
    flags, overlaps = [], False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if first == "VmFlags:":
                if overlaps:
                    flags.append(set(line.split()[1:]))
            elif "-" in first and not first.endswith(":"):  # a mapping's header: lo-hi perms ...
                lo, hi = (int(h, 16) for h in first.split("-"))
                overlaps = lo < address + nbytes and address < hi
    return flags


@pytest.mark.skipif(transparent_huge_pages() == "unknown",
                    reason="the kernel has no transparent huge pages")
def test_large_outputs_are_advised_huge_pages_to_their_edges():
    """An output of 1 MiB or more is advised huge pages over the 2 MiB-aligned range enclosing
    it, before anyone writes (docs/xla_ext.md, "Fresh output pages"): every mapping under a
    4 MiB result carries the kernel's `hg` flag (MADV_HUGEPAGE), its unaligned edges too,
    whatever the kernel's mode (the flag is set even where huge pages are off)."""
    fn = _shard_map(lambda block: {"sum": ext.all_reduce(block, "d")}, MESH_1D)
    out = fn(_place(np.ones((8, 1 << 20), np.float32), MESH_1D))["sum"]  # 4 MiB a member
    for shard in out.addressable_shards:
        assert np.all(np.asarray(shard.data) == 8.0)
        flags = _mapping_flags(shard.data.unsafe_buffer_pointer(), shard.data.nbytes)
        assert flags and all("hg" in f for f in flags), (shard.device, flags)
