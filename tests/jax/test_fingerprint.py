"""The xla_ext fingerprint handler against its NumPy reference, bit for bit."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainspec.jax.fingerprint import fingerprint, fingerprint_reference


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((17, 5)).astype(np.float32),
        "bf16": rng.standard_normal(33).astype(ml_dtypes.bfloat16),
        "f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "i32": rng.integers(-(2**31), 2**31 - 1, 1000, dtype=np.int32),
        "i8_odd_length": rng.integers(-128, 127, 13, dtype=np.int8),
        "bool": rng.integers(0, 2, 9).astype(bool),
        "scalar": np.float32(3.5),
        "empty": np.zeros((0, 4), np.float32),
    }


CASES = _cases()  # fixed arrays (seeded inside), shared read-only by the tests below


@pytest.mark.parametrize("name", CASES)
def test_matches_numpy_reference_bitwise(name):
    x = CASES[name]
    np.testing.assert_array_equal(np.asarray(jax.jit(fingerprint)(x)), fingerprint_reference(x))


def test_one_flipped_bit_changes_fingerprint():
    x = CASES["f32"].copy()
    before = np.asarray(fingerprint(x))
    x.view(np.uint32)[7, 3] ^= 1 << 12
    assert not np.array_equal(before, np.asarray(fingerprint(x)))


def test_swapped_elements_change_fingerprint():
    """Order-independent in how words are combined, but still sensitive to their positions."""
    x = np.arange(16, dtype=np.float32)
    y = x.copy()
    y[[2, 9]] = y[[9, 2]]
    assert not np.array_equal(np.asarray(fingerprint(x)), np.asarray(fingerprint(y)))


def test_trailing_zero_bytes_change_fingerprint():
    x = np.ones(3, np.int8)
    assert not np.array_equal(np.asarray(fingerprint(x)), np.asarray(fingerprint(np.r_[x, 0])))


def test_per_shard_under_shard_map():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.device_put(
        jnp.arange(8 * 12, dtype=jnp.float32).reshape(8, 12), NamedSharding(mesh, P("d"))
    )
    per_shard = jax.jit(
        jax.shard_map(lambda s: fingerprint(s)[None], mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )(x)
    expected = np.stack([fingerprint_reference(row[None]) for row in np.asarray(x)])
    np.testing.assert_array_equal(np.asarray(per_shard), expected)


def test_vmap_fingerprints_each_row():
    x = CASES["f32"]
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(fingerprint)(x)), np.stack([fingerprint_reference(r) for r in x])
    )
