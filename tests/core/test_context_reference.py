"""The context axis's trunk references: the zig-zag index maps and ring attention in float64,
against plain causal attention over the whole sequence."""
import numpy as np
import pytest

from trainspec.core.context import causal_work, positions, split_order, unsplit_order
from trainspec.core.ring_attention import causal_attention, merge_block, ring_attention


def test_zigzag_puts_chunks_i_and_2n_minus_1_minus_i_on_rank_i():
    # 16 tokens, 4 ranks: 8 chunks of 2; rank 0 holds chunks 0 and 7, rank 3 chunks 3 and 4
    pos = positions(16, 4, "zigzag")
    assert pos[0].tolist() == [0, 1, 14, 15]
    assert pos[3].tolist() == [6, 7, 8, 9]
    assert positions(8, 2, "contiguous").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_split_and_unsplit_are_inverse_permutations(split, n):
    order, back = split_order(24, n, split), unsplit_order(24, n, split)
    assert sorted(order.tolist()) == list(range(24))
    x = np.arange(24) * 10
    assert (x[order][back] == x).all()


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    assert len(set(causal_work(64, 4, "zigzag").tolist())) == 1
    work = causal_work(64, 4, "contiguous")
    assert (np.diff(work) > 0).all()  # the last rank does the most


def test_a_length_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="12 does not split into 8"):
        positions(12, 4, "zigzag")


def _qkv(length, seed=0, batch=2, heads=3, dim=4):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(batch, length, heads, dim)) * 2 for _ in range(3)]


@pytest.mark.parametrize("split", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_ring_attention_equals_causal_attention(split, n):
    # float64 all through: the online softmax only reorders sums of exp, so 1e-12 is rounding
    q, k, v = _qkv(16)
    np.testing.assert_allclose(ring_attention(q, k, v, n, split), causal_attention(q, k, v),
                               rtol=1e-12, atol=1e-12)


def test_a_causal_mask_off_by_one_block_is_caught():
    """Attending to the block one position ahead (keys up to the query's own block end) is
    not causal attention: the comparison above must see it."""
    q, k, v = _qkv(16)
    pos = np.arange(16)
    state = (np.full((2, 3, 16), -np.inf), np.zeros((2, 3, 16)), np.zeros_like(q))
    m, l, o = merge_block(state, q, k, v, pos + 2, pos)  # two keys too many per query
    wrong = o / l.transpose(0, 2, 1)[..., None]
    assert np.abs(wrong - causal_attention(q, k, v)).max() > 1e-2


def test_merge_of_a_fully_masked_block_keeps_the_state():
    q, k, v = _qkv(4)
    state = merge_block((np.full((2, 3, 4), -np.inf), np.zeros((2, 3, 4)), np.zeros_like(q)),
                        q, k, v, np.arange(4), np.arange(4))
    after = merge_block(state, q, k, v, np.arange(4), np.arange(4) + 10)  # all in the future
    for a, b in zip(state, after):
        np.testing.assert_array_equal(a, b)
