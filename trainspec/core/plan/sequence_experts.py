"""The reference job's context and expert axes as its program runs them (trainspec.jax.context,
trainspec.jax.models.moe), per device and micro-batch: where the tokens are, and the collectives
the two add. Read off the HLO of compiled steps (docs/plan.md, "Context and expert layouts").

- The batch is split over data, fsdp and expert (an expert axis splits the batch as a data
  axis), each sequence over context: a device holds R rows of t = T / c positions.
- Context: the batch is put in the split order by a gather along the sequence, which XLA
  lowers as an all-gather over context of each of the three (inputs, targets, mask) int32 or
  float32 arrays. `ring`: each layer passes its key and value blocks on c - 1 times (two
  collective-permutes of R t d elements each time) in the forward pass, and their gradients
  back as many times in the backward pass; full remat runs the forward ring again.
  `all_gather`: each layer gathers its keys and values (two all-gathers of R T d elements) and
  reduce-scatters their gradients (two reduce-scatters of the same size). The parameters are
  replicated over context: their gradients are all-reduced over it, once a step, an operation
  of its own beside data's.
- Experts: the router runs over the whole micro-batch (the global view, as the routing's
  capacity bound requires): per MoE layer its probabilities (N x E float32, N the micro-batch's
  tokens) and its top-k choices (k x N x E int32, one-hot) are all-gathered over the batch
  axes. Dispatch and combine are all-to-alls over the expert axes of buffers indexed by token:
  E x R t x d elements, every row to every expert, zeros where the expert did not take it;
  two in the forward pass and two in the backward. The experts' gradients are all-reduced over
  data only; the rest over data and expert together, in one operation.
"""
from __future__ import annotations

from trainspec.core.mesh import ParallelDims
from trainspec.core.spec import Spec

BATCH_ARRAYS = 3  # inputs, targets (int32) and mask (float32): 4 bytes an element each


def batch_axes(layout: ParallelDims) -> tuple[str, ...]:
    """The split mesh axes of the batch dimension (the `batch` logical rule's roles)."""
    return tuple(a for a in layout.names if layout.shape[a] > 1
                 and dict(zip(layout.names, layout.roles))[a] in ("data", "fsdp", "expert"))


def local_rows(spec: Spec, layout: ParallelDims, microbatches: int = 1) -> float:
    """Rows (sequences) of one micro-batch on one device."""
    return spec.batch.micro / layout.group(batch_axes(layout))[0] / microbatches


def local_tokens(spec: Spec, layout: ParallelDims, microbatches: int = 1) -> float:
    """Token positions of one micro-batch on one device: its rows x T / context."""
    context = layout.size_of(layout.split("context"))
    return local_rows(spec, layout, microbatches) * spec.batch.seq_len / context


def collectives(spec: Spec, layout: ParallelDims, calls: float, add) -> None:
    """The context and expert axes' activation traffic of one step (`calls` micro-batches),
    each given to `add(kind, axes, elements, dtype, calls)` (plan.comm)."""
    m, compute = spec.model, spec.precision.compute
    rows, seq = local_rows(spec, layout), spec.batch.seq_len
    context, expert = layout.split("context"), layout.split("expert")
    if context:
        c = layout.size_of(context)
        block = rows * seq / c * m.d_model  # one rank's keys (or values)
        add("all-gather", context, rows * seq, "int32", BATCH_ARRAYS * calls)
        if spec.context.attention == "ring":
            passes = 3 if spec.remat.policy == "full" else 2  # the forward ring again
            add("collective-permute", context, block, compute,
                passes * 2 * (c - 1) * m.n_layers * calls)
        else:
            gathers = 2 if spec.remat.policy == "full" else 1
            add("all-gather", context, block * c, compute, gathers * 2 * m.n_layers * calls)
            add("reduce-scatter", context, block * c, compute, 2 * m.n_layers * calls)
    if expert and m.moe is not None:
        tokens = spec.batch.micro * seq  # the whole micro-batch's
        e, k = m.moe.experts, m.moe.top_k
        add("all-gather", batch_axes(layout), tokens * e, "float32", m.n_layers * calls)
        add("all-gather", batch_axes(layout), k * tokens * e, "int32", m.n_layers * calls)
        passes = 6 if spec.remat.policy == "full" else 4
        add("all-to-all", expert, e * rows * seq * m.d_model, compute,
            passes * m.n_layers * calls)
