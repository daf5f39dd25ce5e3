"""How the xla_ext collective handlers behave inside programs, on 8 simulated CPU devices: in
place (bit-identical to out of place, a donated buffer reused, a live one kept), bitwise
deterministic whatever the members' arrival order, no rendezvous state left after thousands of
calls, no deadlock beside independent collectives and a scan, gradients and vmap as lax's, and
huge-page advice on large outputs. Their values against NumPy and lax are in
test_xla_ext_collectives.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from ext_members import (DTYPES, MESH_1D, member_inputs, on_every_member, per_member, place,
                         rank_order_sum)
from trainspec.jax.collectives import ext
from trainspec.core.topology import transparent_huge_pages


# ---- in place ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_in_place_all_reduce_equals_the_out_of_place_one_bit_for_bit(dtype_name):
    """In place, the result overwrites the input buffer while the other members still read
    theirs: every op gives the same bits as out of place (the same kernel, the same order)."""
    members = member_inputs(DTYPES[dtype_name])
    ops = ("sum", "max", "min") + (("mean",) if dtype_name != "i32" else ())
    x = place(members, MESH_1D)
    out = on_every_member(lambda v: {op: ext.all_reduce(v, "d", op) for op in ops}, MESH_1D)(x)
    inplace = on_every_member(lambda v: {op: ext.all_reduce(v + 0, "d", op, in_place=True)
                                    for op in ops}, MESH_1D)(x)
    for op in ops:
        np.testing.assert_array_equal(np.asarray(inplace[op]).view(np.uint8),
                                      np.asarray(out[op]).view(np.uint8), err_msg=op)


def test_in_place_all_reduce_takes_a_donated_input_buffer_and_leaves_a_live_one_intact():
    spec = P("d")
    x = place(member_inputs(np.float32), MESH_1D)
    want = rank_order_sum(list(member_inputs(np.float32)))
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
    members = member_inputs(np.float32)

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
    x = place(members, MESH_1D)
    runs = [jax.tree.map(np.asarray, f(x, jnp.int32(i % 8))) for i in range(20)]
    exact = rank_order_sum(list(members))
    for r in runs:
        for m in range(8):
            np.testing.assert_array_equal(r["sum"][m].view(np.uint32), exact.view(np.uint32))
        np.testing.assert_array_equal(r["rs"].view(np.uint32), runs[0]["rs"].view(np.uint32))


# ---- state ----------------------------------------------------------------------------------


def test_no_state_leaks_across_thousands_of_calls():
    x = place(np.ones((8, 4), np.float32), MESH_1D)

    def body(v):
        # 2000 invocations of one call site: the per-slot invocation counter at work.
        return {"v": lax.fori_loop(0, 2000, lambda i, c: ext.all_reduce(c, "d", "mean") + 1.0, v)}

    out = per_member(on_every_member(body, MESH_1D)(x), MESH_1D)
    np.testing.assert_array_equal(out["v"][0], np.full(4, 2001.0, np.float32))
    # Separate executions too. Each is awaited: the CPU client deadlocks blocking collectives
    # (lax's included) when many executions are dispatched ahead, see docs/xla_ext.md.
    f = on_every_member(lambda v: {"g": ext.all_gather(v, "d")}, MESH_1D)
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
        return on_every_member(body, MESH_1D)

    shift = [(i, (i + 3) % 8) for i in range(8)]
    f_ext = program(lambda v: ext.all_reduce(v, "d", timeout_s=10),
                    lambda v: ext.all_gather(v, "d", timeout_s=10),
                    lambda v: ext.permute(v, "d", shift, timeout_s=10))
    f_lax = program(lambda v: lax.psum(v, "d"), lambda v: lax.all_gather(v, "d", tiled=True),
                    lambda v: lax.ppermute(v, "d", shift))
    x = place(np.random.default_rng(1).integers(-8, 8, (8, 16)).astype(np.float32), MESH_1D)  # exact in any order
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
        return on_every_member(jax.grad(loss), MESH_1D)

    x = place(members, MESH_1D)
    np.testing.assert_array_equal(np.asarray(grads(ext_op)(x)), np.asarray(grads(lax_op)(x)))


def test_max_is_not_differentiable():
    with pytest.raises(ValueError, match="not differentiable"):
        on_every_member(jax.grad(lambda v: ext.all_reduce(v, "d", "max").sum()), MESH_1D).lower(
            place(np.ones((8, 4), np.float32), MESH_1D))


def test_vmap_runs_one_collective_per_batch_element():
    members = np.random.default_rng(3).integers(-4, 5, (8, 3, 16)).astype(np.float32)

    def body(ar, ag):
        return lambda v: {"ar": jax.vmap(ar)(v), "ag": jax.vmap(ag)(v)}

    x = place(members, MESH_1D)
    got = per_member(on_every_member(body(lambda r: ext.all_reduce(r, "d"),
                                      lambda r: ext.all_gather(r, "d")), MESH_1D)(x), MESH_1D)
    want = per_member(on_every_member(body(lambda r: lax.psum(r, "d"),
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
    fn = on_every_member(lambda block: {"sum": ext.all_reduce(block, "d")}, MESH_1D)
    out = fn(place(np.ones((8, 1 << 20), np.float32), MESH_1D))["sum"]  # 4 MiB a member
    for shard in out.addressable_shards:
        assert np.all(np.asarray(shard.data) == 8.0)
        flags = _mapping_flags(shard.data.unsafe_buffer_pointer(), shard.data.nbytes)
        assert flags and all("hg" in f for f in flags), (shard.device, flags)
