"""How the xla_ext collective handlers fail: specific FFI error codes, at once where possible.

A member that never arrives is DEADLINE_EXCEEDED after the timeout; everything the members
can see is wrong -- operands, a duplicate rank, disagreeing group sizes or attributes -- is
INVALID_ARGUMENT, reported without waiting for the timeout, naming what differs. No failure
leaves rendezvous state behind. Raw `jax.ffi.ffi_call`s reach below the Python checks of
trainspec.jax.collectives.ext, so the handler's own checks are what is tested here.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainspec.jax import collectives
from trainspec.jax.collectives import ext

MESH = Mesh(np.array(jax.devices()), ("d",))
# Generous: the checks below fail in well under a second; a timeout would take this long.
LONG_TIMEOUT_MS = np.int64(30_000)


def _shard_map(body):
    """body maps one member's local array (shape (4,)) to its result; run it on every member."""
    return jax.jit(jax.shard_map(lambda b: body(b[0])[None], mesh=MESH, in_specs=P("d"),
                                 out_specs=P("d"), check_vma=False))


def _ones():
    return jax.device_put(np.ones((8, 4), np.float32), NamedSharding(MESH, P("d")))


def _raw_all_reduce(v, rank, *, call_site, group_size=8, reduce_op=0, out_len=4):
    call = jax.ffi.ffi_call("trainspec_all_reduce", jax.ShapeDtypeStruct((out_len,), v.dtype))
    return call(v, rank.astype(jnp.int32), jnp.int32(0), call_site=np.int64(call_site),
                group_size=np.int64(group_size), timeout_ms=LONG_TIMEOUT_MS,
                reduce_op=np.int64(reduce_op))


def _live_rendezvous_after_settling(limit_s=5.0):
    """The error reaches Python when the first member fails; the others leave moments later."""
    deadline = time.monotonic() + limit_s
    while ext.live_rendezvous_count() and time.monotonic() < deadline:
        time.sleep(0.01)
    return ext.live_rendezvous_count()


def _fails_fast(f, match):
    start = time.monotonic()
    with pytest.raises(Exception, match=match):
        np.asarray(f(_ones()))
    assert time.monotonic() - start < LONG_TIMEOUT_MS / 1000 / 2  # not a timeout
    assert _live_rendezvous_after_settling() == 0


# ---- a member that never arrives ------------------------------------------------------------


def _skip_on_rank(skipped, timeout_s):
    return _shard_map(lambda v: lax.cond(
        lax.axis_index("d") == skipped, lambda u: u,
        lambda u: ext.all_reduce(u, "d", timeout_s=timeout_s), v))


def test_missing_member_is_deadline_exceeded_naming_op_and_ranks_then_recovers():
    start = time.monotonic()
    with pytest.raises(Exception, match=r"DEADLINE_EXCEEDED: trainspec all_reduce.*timed out "
                                        r"after 1 s waiting for ranks \[7\]"):
        np.asarray(_skip_on_rank(7, 1.0)(_ones()))
    assert time.monotonic() - start < 30
    assert _live_rendezvous_after_settling() == 0
    # The failed run left nothing behind: a normal collective works afterwards.
    ok = np.asarray(_shard_map(lambda v: ext.all_reduce(v, "d"))(_ones()))
    np.testing.assert_array_equal(ok, np.full((8, 4), 8.0, np.float32))


def test_missing_member_inside_scan_fails_fast():
    """After the first timeout the run is poisoned: later iterations fail at once."""
    def body(v):
        def step(c, _):
            return lax.cond(lax.axis_index("d") == 3, lambda u: u,
                            lambda u: ext.all_reduce(u, "d", "max", timeout_s=1.0), c), None
        return lax.scan(step, v, None, length=5)[0]

    start = time.monotonic()
    with pytest.raises(Exception, match=r"DEADLINE_EXCEEDED.*waiting for ranks \[3\]"):
        np.asarray(_shard_map(body)(_ones()))
    assert time.monotonic() - start < 4.5  # not 5 timeouts in a row
    assert _live_rendezvous_after_settling() == 0


# ---- what the members can see is wrong: INVALID_ARGUMENT, at once ----------------------------


def test_rank_outside_the_group_is_invalid_argument():
    _fails_fast(_shard_map(lambda v: _raw_all_reduce(v, jnp.int32(9), call_site=0)),
                "INVALID_ARGUMENT: trainspec all_reduce: rank 9 out of range for group size 8")


def test_wrong_output_shape_is_invalid_argument():
    _fails_fast(_shard_map(lambda v: _raw_all_reduce(v, lax.axis_index("d"), call_site=0,
                                                     out_len=3)[:1].repeat(4)),
                r"INVALID_ARGUMENT: .*output shape \[3\] should be \[4\]")


def test_duplicate_rank_fails_at_once_naming_the_rank():
    """Devices 6 and 7 both claim rank 6: nobody waits for the missing rank 7."""
    _fails_fast(_shard_map(lambda v: _raw_all_reduce(
        v, jnp.minimum(lax.axis_index("d"), 6), call_site=1)),
        r"INVALID_ARGUMENT: .*rank 6 joined twice")


def test_group_size_mismatch_fails_at_once():
    """Device 7 says the group has 4 members, the others 8."""
    def body(v):
        last = lax.axis_index("d") == 7
        return lax.cond(last,
                        lambda u: _raw_all_reduce(u, jnp.int32(3), call_site=2, group_size=4),
                        lambda u: _raw_all_reduce(u, lax.axis_index("d"), call_site=2), v)
    _fails_fast(_shard_map(body), r"INVALID_ARGUMENT: .*uses group size (4|8) but another "
                                  r"member of the same group uses (8|4)")


def test_disagreeing_attribute_is_named():
    """Even ranks ask for a sum, odd ones for a max, at the same call site."""
    def body(v):
        odd = lax.axis_index("d") % 2 == 1
        return lax.cond(odd,
                        lambda u: _raw_all_reduce(u, lax.axis_index("d"), call_site=3,
                                                  reduce_op=2),
                        lambda u: _raw_all_reduce(u, lax.axis_index("d"), call_site=3), v)
    _fails_fast(_shard_map(body), r"INVALID_ARGUMENT: .*disagrees with rank \d on reduce_op: "
                                  r"\[(0|2)\] vs \[(2|0)\]")


def test_disagreeing_dtype_is_named():
    def body(v):
        half = lax.axis_index("d") < 4
        return lax.cond(half,
                        lambda u: _raw_all_reduce(u.astype(jnp.bfloat16), lax.axis_index("d"),
                                                  call_site=4).astype(jnp.float32),
                        lambda u: _raw_all_reduce(u, lax.axis_index("d"), call_site=4), v)
    _fails_fast(_shard_map(body), r"INVALID_ARGUMENT: .*on dtype: (float32|bfloat16) vs "
                                  r"(bfloat16|float32)")


# ---- the Python checks (trace time) -----------------------------------------------------------


def _api(op, *args, **kwargs):  # the ext backend through the API, which validates for it
    return lambda v: getattr(collectives, op)(v, *args, backend="ext", **kwargs)


F32, I32, U8 = np.float32, np.int32, np.uint8


@pytest.mark.parametrize("call,dtype,message", [
    (_api("reduce_scatter", "d", scatter_dimension=1), F32, "not divisible by the group size 8"),
    (_api("all_to_all", "d", 1, 0), F32, "not divisible by the group size 8"),
    (_api("all_gather", "d", axis=2), F32, "out of range"),
    (_api("all_reduce", "d", "prod"), F32, "op must be one of"),
    (_api("all_reduce", "d", "mean"), I32, "needs a floating dtype"),
    (_api("broadcast", "d", 8), F32, "root must be an int in"),
    (_api("permute", "d", [(0, 1), (2, 1)]), F32, "destinations must be unique"),
    (_api("all_reduce", "d"), U8, "not supported by the ext backend"),
    (_api("all_reduce", "nope"), F32, "not a manual axis"),
    (_api("all_reduce", "d", timeout_s=0), F32, "timeout_s must be a positive number"),
    (_api("all_reduce", "d", in_place=1), F32, "in_place must be True or False, got 1"),
])
def test_bad_arguments_raise_value_error_at_trace_time(call, dtype, message):
    f = jax.jit(jax.shard_map(lambda b: call(b[0])[None], mesh=MESH, in_specs=P("d"),
                              out_specs=P("d"), check_vma=False))
    with pytest.raises(ValueError, match=message):
        f.lower(jax.device_put(np.ones((8, 8, 3), dtype), NamedSharding(MESH, P("d"))))


def test_outside_shard_map_is_a_clear_error():
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        jax.jit(_api("all_reduce", "d")).lower(np.ones(3, np.float32))
