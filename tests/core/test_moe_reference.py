"""MoE routing in the trunk (trainspec/core/moe.py): top-k, capacity and its drop order, the
dispatch/combine maps, expert load and the auxiliary losses, against hand-worked cases and a
per-token float64 computation."""
import numpy as np
import pytest

from trainspec.core.moe import (
    capacity, combine, load_balance_loss, moe_layer, route, softmax, z_loss)


def test_capacity_rounds_up_and_zero_is_dropless():
    assert capacity(tokens=10, experts=4, top_k=2, capacity_factor=1.0) == 5
    assert capacity(tokens=10, experts=4, top_k=1, capacity_factor=1.25) == 4  # ceil(3.125)
    assert capacity(tokens=10, experts=4, top_k=2, capacity_factor=0) == 10


def test_drop_order_first_choices_before_second_then_token_order():
    # 4 tokens, 2 experts, top 2, capacity ceil(0.5 * 4 * 2 / 2) = 2: every token prefers
    # expert 0 except token 2. Expert 0's two slots go to tokens 0 and 1 (first choices, in
    # order); token 3's first choice is dropped. Expert 1 takes token 2 (first choice) and then
    # token 0's second choice; the second choices of tokens 1, 2 and 3 are dropped: 4 drops.
    logits = np.array([[2.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    r = route(logits, top_k=2, capacity_factor=0.5)
    assert r.experts.tolist() == [[0, 1], [0, 1], [1, 0], [0, 1]]
    assert r.dispatch.tolist() == [[0, 1], [2, 0]]
    assert r.slot.tolist() == [[0, 1], [1, -1], [0, -1], [-1, -1]]
    assert r.dropped == 4 and r.load.tolist() == [4, 4]


def test_ties_go_to_the_lower_expert_and_gates_sum_to_one():
    r = route(np.zeros((3, 4)), top_k=2, capacity_factor=0)
    assert r.experts.tolist() == [[0, 1]] * 3
    np.testing.assert_allclose(r.gates.sum(-1), 1.0)
    assert r.dropped == 0 and r.load.tolist() == [3, 3, 0, 0]
    assert r.load_max_over_mean == 2.0


def _experts(n, width, hidden, seed=1):
    rng = np.random.default_rng(seed)
    w_in, w_out = rng.normal(size=(n, width, hidden)), rng.normal(size=(n, hidden, width))
    return lambda e, rows: np.tanh(rows @ w_in[e]) @ w_out[e]


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_the_layer_equals_each_token_summed_over_its_kept_experts(capacity_factor):
    rng = np.random.default_rng(0)
    x, router = rng.normal(size=(12, 6)), rng.normal(size=(6, 4))
    expert = _experts(4, 6, 5)
    out, r = moe_layer(x, router, expert, top_k=2, capacity_factor=capacity_factor)
    expected = np.zeros_like(x)
    for t in range(12):
        for j in range(2):
            if r.slot[t, j] >= 0:
                expected[t] += r.gates[t, j] * expert(r.experts[t, j], x[t])
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    assert (r.dropped > 0) == (capacity_factor > 0)  # this draw overflows capacity 6


def test_combining_in_the_wrong_order_is_caught():
    """Rows combined with the slots of another expert's buffer give another output."""
    rng = np.random.default_rng(0)
    x, router = rng.normal(size=(12, 6)), rng.normal(size=(6, 4))
    expert = _experts(4, 6, 5)
    out, r = moe_layer(x, router, expert, top_k=2, capacity_factor=0)
    gathered = np.where(r.dispatch[..., None] >= 0, x[r.dispatch], 0.0)
    expert_out = np.stack([expert(e, gathered[e]) for e in range(4)])
    np.testing.assert_allclose(combine(expert_out, r), out)
    assert np.abs(combine(expert_out[::-1], r) - out).max() > 1e-2


def test_auxiliary_losses_by_hand():
    # uniform probabilities: P_e = 1/E whatever the load, so the balance loss is exactly 1
    assert load_balance_loss(route(np.zeros((5, 4)), 1, 0)) == pytest.approx(1.0)
    # all tokens on expert 0 with probability p: E * (1 * p) = 2p for E = 2
    logits = np.array([[1.0, 0.0]] * 3)
    p = softmax(logits)[0, 0]
    assert load_balance_loss(route(logits, 1, 0)) == pytest.approx(2 * p)
    # z-loss: logsumexp([1, 0]) = log(e + 1), squared
    assert z_loss(logits) == pytest.approx(np.log(np.e + 1) ** 2)
