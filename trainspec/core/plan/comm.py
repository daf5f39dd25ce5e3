"""The collectives of one step, per device, as the train step (trainspec.jax.step) and XLA's
SPMD partitioner emit them for the reference model; per step with K micro-batches, R rows per
device and micro-batch, T tokens per row, L layers, width d:

- fsdp > 1: each parameter fsdp splits is all-gathered over fsdp (`gathers_per_step`), and
  each micro-batch's gradient is reduce-scattered over fsdp;
- data > 1: one all-reduce of the packed local gradient per step (the explicit replica
  reduction of step.py when K > 1 or the backend is not xla); under ZeRO-1 (`layout.
  optimizer_state = "shard_over_data"`) each parameter updated on a data slice is all-gathered
  back over data. Semi-synchronous training has neither: each group reduces over its own
  axes only, and every H steps the outer step all-reduces the float32 parameter deltas over
  data (1/H of an all-reduce a step);
- tensor > 1: per micro-batch, all-reduces of (2 + 6 L) activations of R x T x d elements
  (forward: embedding, attention and MLP outputs; backward: the input gradients of the head,
  mlp_in, q, k and v) plus 4 per-token scalars of the vocabulary-split softmax loss, in
  (2 + 4 L) + 3 operations (XLA combines the q, k and v input gradients into one all-reduce,
  one scalar rides with an activation); with full remat, each block's recomputed attention
  output once more (its MLP output is not needed by the backward, so not recomputed);
- pipeline > 1 (of one stage, `Stage`): the tensor traffic above for the stage's own layers
  (the embedding's on the first stage, the head's and the loss scalars on the last), per
  pipeline micro-batch of 1/m of the rows; and point to point over the pipeline axis, per
  pipeline micro-batch and chunk boundary, the boundary's activation (R x T x d / m elements)
  forward and its gradient back: 2 v sends less one on the first and one on the last stage,
  each a collective-permute between two devices (a whole activation per tensor rank: no
  scatter over the tensor axis), on the DCN link when the pipeline axis spans hosts;
- every step on more than one device, under `health.nan.policy` skip or halt: the NaN guard's
  all-reduce of one int32, its count of non-finite state slices, over the whole mesh (each
  group's own axes under semi_sync). Under rollback (the default) each device only flags its
  own slices and the host reads the flags a step late: no collective.

Which backend runs them matters: XLA:CPU lowers a reduce-scatter to an all-reduce and a slice
(`Profile.reduce_scatter_as_all_reduce`), and moves 16-bit data as float32 in every collective
of the step (`Profile.collectives_16bit_as_float32`): its all-reduce promotion pass widens the
all-reduces, and it converts 16-bit parameters to float32 before gathering them.
"""
from __future__ import annotations

import dataclasses

from trainspec.core.health import rolls_back
from trainspec.core.mesh import ParallelDims
from trainspec.core.plan import sequence_experts
from trainspec.core.plan.hardware import Profile, bus_factor
from trainspec.core.plan.sequence_experts import local_tokens
from trainspec.core.plan.shards import (
    DTYPE_BYTES, Stage, data_split_shares, local_elements, shares)
from trainspec.core.plan.transformer import Param
from trainspec.core.spec import Spec

LOSS_SCALARS_PER_TOKEN = 4  # vocabulary-split log-softmax: max, sum, target logit, backward sum
LOSS_OPS = 3  # the all-reduces that carry them (XLA sends one along with an activation)


def guard_meets(spec: Spec) -> bool:
    """Whether the NaN guard decides on device, every device agreeing (skip and halt: an
    all-reduce, and a copy of the state it keeps); under rollback the step is the user's own
    and the run loop judges it a few steps late (trainspec.core.run)."""
    return not rolls_back(spec.health.nan)


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    bytes: float        # S per device per call (nccl-tests' convention, as metrics/comm.py)
    calls: float        # per step (1/H: once every H steps)
    group: int          # devices in one group
    group_dcn: int      # of which across hosts: the group spans group_dcn ICI domains
    ops: float          # collective operations per step, each paying the link's latency

    @property
    def bytes_per_step(self) -> float:
        return self.bytes * self.calls

    @property
    def ici_bus_bytes(self) -> float:
        return self.bytes_per_step * bus_factor(self.kind, self.group // self.group_dcn)

    @property
    def dcn_bus_bytes(self) -> float:
        """Hierarchical: the cross-host stage moves the 1/ici share each domain holds."""
        ici = self.group // self.group_dcn
        return self.bytes_per_step / ici * bus_factor(self.kind, self.group_dcn)


def regathered_by_remat(p: Param, spec: Spec) -> bool:
    """Whether a rematerialised block gathers this kernel again, for its recomputation in
    every micro-batch: jax.checkpoint's barrier keeps the gather inside the block when the
    kernel is used in its stored dtype (with a cast to the compute dtype, made before the
    model, XLA gathers the stored parameter once, before the cast, outside the block)."""
    return (p.in_block and not p.gathered_by_xla and spec.remat.policy != "none"
            and spec.precision.compute == spec.precision.param)


def gathers_per_step(p: Param, spec: Spec) -> int:
    """All-gathers of a parameter fsdp splits, per step. XLA hoists a gather out of the
    micro-batch loop, once, unless it stays in a rematerialised block: a norm scale (gathered
    by XLA at each use, for the forward and for the backward) is then gathered again for the
    recomputation and for the backward of every micro-batch, and a kernel as
    `regathered_by_remat` says."""
    k = spec.batch.accumulation_steps
    if p.gathered_by_xla:
        return 1 + 2 * k if p.in_block and spec.remat.policy != "none" else 2
    return 1 + k if regathered_by_remat(p, spec) else 1


def element_bytes(dtype: str, profile: Profile) -> int:
    """Bytes one element of `dtype` moves in the step's collectives on the profile's backend."""
    if profile.collectives_16bit_as_float32:
        return max(DTYPE_BYTES[dtype], 4)
    return DTYPE_BYTES[dtype]


def collectives(spec: Spec, layout: ParallelDims, profile: Profile, stage: Stage | None = None,
                microbatches: int = 1) -> list[Collective]:
    k, m, precision = spec.batch.accumulation_steps, spec.model, spec.precision
    data, fsdp, tensor = (layout.split(r) for r in ("data", "fsdp", "tensor"))
    semi_sync = spec.semi_sync is not None
    reduce_scatter = "all-reduce" if profile.reduce_scatter_as_all_reduce else "reduce-scatter"
    out = []

    def add(kind, axes, elements, dtype, calls, ops=None, extra_bytes=0.0):
        n, n_dcn = layout.group(axes)
        nbytes = elements * element_bytes(dtype, profile) + extra_bytes
        out.append(Collective(kind, axes, float(nbytes), calls, n, n_dcn,
                              calls if ops is None else ops))

    local = local_elements(spec, layout, stage=stage)
    if fsdp:
        split = {s.param.path for s in shares(spec, layout, stage=stage) if s.axes & set(fsdp)}
        gathered = [(s, gathers_per_step(s.param, spec))
                    for s in shares(spec, layout, skip=fsdp, stage=stage) if s.param.path in split]
        add("all-gather", fsdp, sum(s.elements * g for s, g in gathered), precision.param, 1,
            sum(g for _, g in gathered))
        add(reduce_scatter, fsdp, local_elements(spec, layout, skip=fsdp, stage=stage),
            precision.grad_reduce, k)
    if data and semi_sync:  # the outer step's float32 parameter deltas, every H steps
        add("all-reduce", data, local, "float32", 1 / spec.semi_sync.inner_steps)
    elif data or layout.split("expert"):
        # an expert's gradient over the data axes; the rest over the batch's (data, expert),
        # by XLA every micro-batch where an expert axis splits (the accumulator is replicated
        # over it; with a data axis too, accumulation is refused: trainspec.jax.capabilities)
        experts = set(layout.split("expert"))
        within = sum(s.elements for s in shares(spec, layout, stage=stage) if s.axes & experts)
        batch = tuple(a for a in layout.names if a in data or a in experts)
        add("all-reduce", batch, local - within, precision.grad_reduce, k if experts else 1)
        if data and within:
            add("all-reduce", data, within, precision.grad_reduce, 1)
        regathered = data_split_shares(spec, layout, stage)
        if regathered:
            add("all-gather", data, sum(s.elements for s in regathered), precision.param, 1,
                len(regathered))
    guarded = tuple(a for a, size in layout.shape.items()
                    if size > 1 and not (semi_sync and a in data))
    if layout.split("context"):  # by XLA every micro-batch: parameters are replicated over it
        add("all-reduce", layout.split("context"), local, precision.grad_reduce, k)
    if guarded and guard_meets(spec):  # the NaN guard's count of non-finite state slices (one int32)
        add("all-reduce", guarded, 1, "int32", 1)
    # per pipeline micro-batch (the whole micro-batch without a pipeline)
    tokens = local_tokens(spec, layout, microbatches)
    calls = k * microbatches
    sequence_experts.collectives(spec, layout, calls, add)
    layers, first, last = ((len(stage.layers), stage.first, stage.last) if stage
                           else (m.n_layers, True, True))
    if tensor:
        recomputed = layers if spec.remat.policy == "full" else 0
        add("all-reduce", tensor, (first + last + 6 * layers + recomputed) * tokens * m.d_model,
            precision.compute, calls,
            calls * (first + last + 4 * layers + recomputed + last * LOSS_OPS),
            extra_bytes=last * LOSS_SCALARS_PER_TOKEN * tokens * 4)  # the loss scalars: float32
    if stage is not None and layout.stages > 1:
        sends = 2 * spec.pipeline.virtual_stages - first - last
        pipeline = layout.split("pipeline")
        crosses = 2 if layout.group(pipeline)[1] > 1 else 1  # a boundary between hosts
        out.append(Collective("collective-permute", pipeline,
                              float(tokens * m.d_model * element_bytes(precision.compute, profile)),
                              calls * sends, 2, crosses, calls * sends))
    return out
