"""Published models and the layouts they were trained with, as the planner checks them
(docs/plan.md). Shapes from each model's released configuration; layouts from the papers.

- Mixtral-8x7B (Jiang et al. 2024, "Mixtral of Experts"; HF config.json): d 4096, 32 layers,
  32 heads of 128, 8 key/value heads, SwiGLU width 14336, 8 experts, top 2, vocabulary 32000;
  46.7B parameters, 12.9B active per token.
- DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437; HF config.json): d 7168, 61 layers, the
  first 3 dense (width 18432), then 256 routed experts (width 2048) plus 1 shared, top 8;
  multi-head latent attention (128 heads, q rank 1536, kv rank 512, query/key width 128 + 64
  rotary, value width 128); vocabulary 129280; 671B parameters, 37B active. Trained on 2,048
  H800 with 16-way pipeline, 64-way expert (over 8 nodes) and ZeRO-1 data parallelism, 4K
  sequences, AdamW moments in bfloat16 with float32 master weights and gradients (sec. 3.2,
  3.3).
- Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3 and Table 4): d 16384,
  126 layers, 128 heads, 8 key/value heads, SwiGLU width 53248, vocabulary 128256. Its
  8K phase: 16,384 H100 as tensor 8 x pipeline 16 x data 128, 16 sequences of 8,192 tokens per
  data replica, trained without activation checkpointing (sec. 3.3.2). Its long-context phase:
  tensor 8 x context 16 x pipeline 16 x data 8, sequences of 131,072 tokens, 16 per data
  replica (Table 4 prints DP 4 for this row in arXiv 2407.21783; the 16,384 GPUs and 16M tokens
  a step need 8).
"""
from __future__ import annotations

from trainspec.core.decoder_shape import DecoderShape
from trainspec.core.plan.sharded_decoder import Layout, Precision


def _mla_params(d: int, heads: int, q_rank: int, kv_rank: int, nope: int, rope: int,
                v: int) -> int:
    """Multi-head latent attention per layer: query down/up projections (with the rank's
    norm), the joint key/value down projection (with the shared rotary key) and its norm, the
    key/value up projection, the output projection."""
    return (d * q_rank + q_rank + q_rank * heads * (nope + rope) + d * (kv_rank + rope)
            + kv_rank + kv_rank * heads * (nope + v) + heads * v * d)


MIXTRAL_8X7B = DecoderShape(
    "Mixtral-8x7B", d_model=4096, n_layers=32, n_heads=32, head_dim=128, kv_heads=8,
    d_ff=14336, vocab=32000, gated_mlp=True, experts=8, top_k=2)

DEEPSEEK_V3 = DecoderShape(
    "DeepSeek-V3", d_model=7168, n_layers=61, n_heads=128, head_dim=192, v_head_dim=128,
    kv_heads=128, d_ff=18432, vocab=129280, gated_mlp=True,
    attention_params=_mla_params(7168, 128, 1536, 512, 128, 64, 128),
    experts=256, top_k=8, shared_experts=1, expert_d_ff=2048, dense_layers=3)

LLAMA_3_405B = DecoderShape(
    "Llama-3-405B", d_model=16384, n_layers=126, n_heads=128, head_dim=128, kv_heads=8,
    d_ff=53248, vocab=128256, gated_mlp=True)

# DeepSeek-V3's optimizer: float32 master weights and gradients, AdamW moments in bfloat16
DEEPSEEK_PRECISION = Precision(param=2, grad=4, optimizer=4 + 2 + 2)

# 15,360 sequences per step at the end of the batch-size schedule (sec. 4.2), one sequence per
# micro-batch: 120 per replica of the 128 that data x expert make.
DEEPSEEK_V3_LAYOUT = Layout(
    {"pipeline": 16, "expert": 64, "data": 2}, micro_batch=1, micro_batches=120, seq_len=4096,
    precision=DEEPSEEK_PRECISION, zero=1, full_remat=True)

# No published 8-GPU training layout (Megatron-LM users report 16 H100 with expert 8); on 8:
# expert 8 with 16-bit parameters and optimizer state (precision.param = "bfloat16")
MIXTRAL_8X7B_8 = Layout({"expert": 8}, micro_batch=1, micro_batches=8, seq_len=4096,
                        precision=Precision(param=2, grad=2, optimizer=4), full_remat=True)

LLAMA_3_405B_128K = Layout(
    {"tensor": 8, "context": 16, "pipeline": 16, "data": 8}, micro_batch=1, micro_batches=16,
    seq_len=131072, zero=1, full_remat=True)

# Llama 3 405B's 8K phase (Table 4, sec. 3.3.2): 16 sequences per data replica, one a
# micro-batch; FSDP over data that shards the optimizer state and the gradients but keeps the
# parameters gathered from the forward to the backward (ZeRO-2), gradients accumulated and
# reduce-scattered in float32; the interleaved schedule with 8 chunks a stage (not published:
# the only count whose equal chunks leave the first chunk the embedding alone and the first
# and last stages one layer fewer, docs/plan.md); no activation checkpointing.
LLAMA_3_405B_8K = Layout(
    {"tensor": 8, "pipeline": 16, "data": 128}, micro_batch=1, micro_batches=16, seq_len=8192,
    precision=Precision(param=2, grad=4, optimizer=12), zero=2,
    schedule="interleaved_1f1b", virtual_stages=8)

# `trainspec plan --published NAME`: each with the hardware it ran on
PUBLISHED = {
    "llama3-405b-8k": (LLAMA_3_405B, LLAMA_3_405B_8K, "h100_sxm"),
    "llama3-405b-128k": (LLAMA_3_405B, LLAMA_3_405B_128K, "h100_sxm"),
    "deepseek-v3": (DEEPSEEK_V3, DEEPSEEK_V3_LAYOUT, "h800"),
    "mixtral-8x7b": (MIXTRAL_8X7B, MIXTRAL_8X7B_8, "h100_sxm"),
}
