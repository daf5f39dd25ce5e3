"""Parameter counts and model FLOPs of decoders with experts: active parameters only, checked
by hand on a Mixtral-8x7B-shaped config and against the published totals of DeepSeek-V3 and
Llama 3 405B; the reference model's count agrees with the existing dense formula."""
import pytest

from trainspec.core.decoder_shape import reference_shape
from trainspec.core.plan.published import DEEPSEEK_V3, LLAMA_3_405B, MIXTRAL_8X7B
from trainspec.core.spec import load_spec
from trainspec.core.transformer_flops import for_spec


def test_mixtral_parameters_and_flops_by_hand():
    # per layer: attention 2*4096*4096 (q, o) + 2*4096*1024 (k, v); one SwiGLU expert
    # 3*4096*14336; the router 4096*8; two norms of 4096; plus the final norm, the embedding
    # and the untied head, 32000*4096 each
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    assert attention == 41_943_040
    expert = 3 * 4096 * 14336
    assert expert == 176_160_768
    rest = 32 * (attention + 4096 * 8 + 2 * 4096) + 4096 + 2 * 32000 * 4096
    total = rest + 32 * 8 * expert
    active = rest + 32 * 2 * expert
    assert (total, active) == (46_702_792_704, 12_879_925_248)  # "46.7B", "12.9B active"
    assert MIXTRAL_8X7B.total_params == total and MIXTRAL_8X7B.active_params == active
    # model FLOPs per token at 4096 tokens: 6 x (active less the embedding table) + attention
    # 6 L H (d_qk + d_v) T = 12 L H d_head T, no causal discount
    seq = 4096
    by_hand = 6 * (active - 32000 * 4096) + 12 * 32 * 32 * 128 * seq
    assert by_hand == 82_935_570_432
    assert MIXTRAL_8X7B.model_flops_per_token(seq) == by_hand
    assert MIXTRAL_8X7B.model_flops_per_token(seq, "causal_discount") == (
        by_hand - 6 * 32 * 32 * 128 * seq)
    # a dense model with all 8 experts active would count 4x the MLP work: MFU would be
    # overstated by that much
    assert MIXTRAL_8X7B.model_flops_per_token(seq) < 0.3 * 6 * total


@pytest.mark.parametrize("shape, total, active", [
    (DEEPSEEK_V3, 671e9, 37e9),     # "671B total parameters with 37B activated"
    (LLAMA_3_405B, 405e9, 405e9),   # dense: every parameter active
])
def test_published_totals(shape, total, active):
    assert shape.total_params == pytest.approx(total, rel=0.01)
    assert shape.active_params == pytest.approx(active, rel=0.02)


def test_the_reference_model_counts_agree_dense_and_count_active_experts():
    dense = load_spec({})
    flops = for_spec(dense)
    m = dense.model
    by_hand = m.n_layers * (4 * m.d_model**2 + 2 * m.d_model * m.d_ff) + (
        2 * m.n_layers + 1) * m.d_model + m.d_model * m.vocab_size
    assert flops.non_embedding_params == by_hand
    moe = load_spec({"model": {"moe": {"experts": 4, "top_k": 2}}})
    sparse = for_spec(moe)
    mlp, router = 2 * m.d_model * m.d_ff, m.d_model * 4
    assert sparse.non_embedding_params == by_hand + m.n_layers * (mlp + router)  # 2 of 4 active
    assert sparse.total_params == flops.total_params + m.n_layers * (3 * mlp + router)
    assert reference_shape(moe.model).expert_params == m.n_layers * 4 * mlp
