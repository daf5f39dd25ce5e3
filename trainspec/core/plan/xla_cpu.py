"""What XLA:CPU keeps live at the peak of the reference model's train step (the CPU profile's
`backend`). The accelerator profiles count what the backward pass needs
(transformer.token_activations); XLA:CPU keeps more, and remat saves it nothing:

- it computes in float32 what it has no 16-bit kernel for: a bfloat16 matmul is a float32 one
  on converted copies, and the softmax and the norms stay float32;
- it schedules a rematerialised block's recomputation as soon as the block's inputs exist, so
  at the start of the backward pass every block's forward buffers are live, whatever the
  remat policy (the same bytes as without remat, on every policy and layout measured);
- it keeps float32 copies of the weights as the matmuls use them (gathered over fsdp, split
  by tensor), for the forward and, transposed, for the backward;
- its heap packs the buffers with some slack (`HEAP_SLACK`).

Each count was read off the buffer assignment of compiled steps (`--xla_dump_to`: the buffers
live at the heap's peak) of a model whose widths are all distinct (d 96, 12 heads, d_ff 320,
V 256, T 72, 2 layers) on 8 layouts (1 device; data, fsdp, tensor and their mixtures on 8),
float32 and bfloat16 compute, one and two micro-batches (docs/plan.md, jax 0.10.2). The shipped
examples, the plan test's grid and its validation model are other models: they check it.
"""
from __future__ import annotations

from trainspec.core.spec import ModelSpec, Spec

# Heap size over the bytes live at its peak: 1.00-1.16 on the layouts measured, median 1.03.
HEAP_SLACK = 1.05


def activation_bytes(m: ModelSpec, seq_len: int, tensor: int, compute: str,
                     scales_gathered: bool, context: int = 1, attention: str = "ring") -> float:
    """Bytes per token position live at the start of the backward pass, with d_t, f_t, V_t
    the widths the tensor axis splits and S = 2 H T / tensor the scores and probabilities:
    float32 compute: (6 L + 4) d + L (4 d_t + S + 3 f_t) + 3 V_t, all float32;
    bfloat16: float32 (4 L + 3) d + L (4 d_t + S + f_t) + 3 V_t, bfloat16 (2 L + 1) d + 4 L f_t.
    The residual stream's d-wide buffers are each block's input, its two norms' outputs and the
    residual after attention, the final norm and the embedding. With the norm scales not split
    over fsdp (fsdp = 1), XLA:CPU fuses each norm differently and keeps a third d-wide buffer
    per norm (2 L + 1 more, float32). A split context axis and a mixture of experts change the
    attention's and the MLP's terms (`context_attention`, `moe_mlp`)."""
    d, L = m.d_model, m.n_layers
    norms = 0 if scales_gathered else 2 * L + 1
    d_t, f_t, v_t = d / tensor, m.d_ff / tensor, m.vocab_size / tensor
    scores = 2 * m.n_heads * seq_len / tensor
    if context > 1:
        scores = context_attention(m, seq_len, context, attention)
    if compute == "float32":
        mlp = moe_mlp(m) if m.moe is not None else 3 * f_t
        return 4 * ((6 * L + 4 + norms) * d + L * (4 * d_t + scores + mlp) + 3 * v_t)
    # a MoE layer's buffers counted as float32 (bfloat16 compute: within 6% on expert 2)
    mlp_32, mlp_16 = (moe_mlp(m), 0) if m.moe is not None else (f_t, 4 * f_t)
    return (4 * ((4 * L + 3 + norms) * d + L * (4 * d_t + scores + mlp_32) + 3 * v_t)
            + 2 * ((2 * L + 1) * d + L * mlp_16))


def context_attention(m: ModelSpec, seq_len: int, context: int, attention: str) -> float:
    """Elements per local token and layer of attention under a split context axis
    (trainspec.jax.context), in place of the 2 H T of scores and probabilities: for every
    key/value block, H x T in all each (c blocks of t keys for the ring, one of T for
    all_gather), float32: the scores, the causally masked scores, the probabilities, and the
    mask of each row's maximum that the maximum's derivative reads (4 H T). XLA:CPU keeps that
    mask to the backward pass for large blocks (64 x 64 keys and more, the context example's
    128 x 128 among them) and reduces it as soon as it is made for small ones (36 x 36 and
    fewer): there the plan is H T a layer high (docs/plan.md). The ring also keeps each block's
    partial output (c x d) and the blocks it received (c - 1 keys or values, d each: the other
    of each pair is read as it arrives)."""
    blocks = 4 * m.n_heads * seq_len
    if attention == "ring":
        return blocks + (2 * context - 1) * m.d_model
    return blocks


def moe_mlp(m: ModelSpec) -> float:
    """Elements per local token and MoE layer (trainspec.jax.models.moe): every expert runs on
    every row (zeros where it did not take it), so the hidden units are E x d_ff wide (3: the
    input projection, its tanh and the GELU's product), and the dispatched rows E x d."""
    e = m.moe.experts
    return 3 * e * m.d_ff + 2 * e * m.d_model


def weight_bytes(spec: Spec, gathered: float, regathered: float, fsdp: bool) -> float:
    """Bytes of float32 copies of the weights, as the matmuls use them, live at the
    micro-batch peak: `gathered` is the elements of the parameters a device holds once fsdp
    has gathered them, `regathered` of those a rematerialised block gathers again for its
    recomputation (plan.comm.regathered_by_remat). One micro-batch: 0.9 of the gathered
    elements (part of them, with the gradients already made). Inside the micro-batch loop: with
    16-bit compute 2.0, the float32 conversions of each weight for the forward and the
    backward matmul (a regathered kernel is one of them); with float32 compute and fsdp 1.3,
    the gathered weights and the transposed copies the backward reads, and the regathered
    kernels beside them; without fsdp the weights are the step's arguments and 0.3 of them is
    copied, transposed."""
    if spec.batch.accumulation_steps == 1:
        return 4 * 0.9 * gathered
    if spec.precision.compute != "float32":
        return 4 * 2.0 * gathered
    return 4 * ((1.3 if fsdp else 0.3) * gathered + regathered)
