"""`trainspec.torch.wrap`: the spec's train step around a user's own nn.Module, with the promises
trainspec.jax.wrap(loss_step(loss_fn), spec) makes on JAX (docs/adapters.md, "Your own PyTorch
model"): the layout onto the spec's DeviceMesh (trainspec/torch/layout.py), token-weighted
accumulation, the precision policy, the optimizer, schedule and clipping of `[optimizer]`, the
non-finite policy of `[health.nan]`, replica fingerprints and checkpoints.

Gradients: each micro-batch's loss *sum* is back-propagated; FSDP2 reduce-scatters the sums over
the fsdp axis once per step, the local gradients are all-reduced over the data axes once per step
(while the last backward runs, in buckets: trainspec/torch/overlap.py; under fsdp or
`collectives.compression`, after it, packed into one buffer: trainspec/torch/reduction.py), and
everything is divided once by the valid tokens of the whole global batch
(trainspec/core/accumulation.py's rule). `device_step` reads nothing on the host: the
non-finite verdict, the schedule's rate and clipping are decided on the device and the spec's
fused optimizers skip a dropped update there (docs/adapters.md, "host reads"). `remat.policy`
checkpoints the units (trainspec/torch/remat.py), `layout.optimizer_state` may split the
optimizer state over the data replicas (trainspec/torch/optimizer_state.py), and `metrics.gns`
adds the gradient noise scale's parts to the metrics (trainspec/torch/gns.py).

The step's other parts: the checks of what the user hands in (trainspec/torch/step_inputs.py),
the micro-batch loops (trainspec/torch/micro_batches.py), and the checkpoints and replica
checks (trainspec/torch/step_state.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec
from trainspec.torch.mesh import group_of
from trainspec.torch.runtime import TORCH_DTYPES, TorchRuntime
from trainspec.torch.context import ContextSplit
from trainspec.torch.gns import StepNoiseScale
from trainspec.torch.guard import DeviceGuard
from trainspec.torch.layout import (
    apply_fsdp, apply_tensor_parallel, check_rules_match, default_tensor_plan, local_block, rows,
    shard_units)
from trainspec.torch.micro_batches import MicroBatches
from trainspec.torch.norms import Norms
from trainspec.torch.models.moe import lay_out_experts, routing_of
from trainspec.torch.optim import spec_optimizer
from trainspec.torch.optimizer_state import StepOptimizer, check_shardable
from trainspec.torch.overlap import OverlappedReduction
from trainspec.torch.pipeline import PipelineIO, stage_pipeline
from trainspec.torch.reduction import DataReduction, model_order
from trainspec.torch.remat import apply_remat
from trainspec.torch.replicated import ReplicatedSum
from trainspec.torch.semi_sync import OuterStep
from trainspec.torch.step_inputs import build_model, check_mesh, check_optimizer
from trainspec.torch.step_state import CheckpointedState
from trainspec.torch.support import batch_axes, check_layout, token_axes
from trainspec.torch.update import DeviceUpdate

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def wrap(model_fn: Callable[[], nn.Module], loss_fn: Callable, spec: Spec, *,
         optimizer_fn: Callable | None = None, mesh: DeviceMesh | None = None,
         device: torch.device | None = None, **options) -> WrappedStep:
    """The spec's train step for the model `model_fn()` builds (see WrappedStep). Without a
    `mesh`, joins the job the environment describes (`trainspec launch`, torchrun; a one-rank
    job when none) and lays the spec's mesh over its ranks."""
    if mesh is None:
        adapter = TorchRuntime(spec.collectives.timeout_s)
        adapter.join()
        mesh = adapter.build_mesh(spec)
    return WrappedStep(model_fn, loss_fn, spec, optimizer_fn=optimizer_fn, mesh=mesh,
                       device=device or TorchRuntime().device, **options)


class WrappedStep(MicroBatches, CheckpointedState):
    """Model, optimizer and step of one rank.

    - `model_fn()` builds the model, with torch's generator seeded by `spec.seed`; every rank
      then takes rank 0's parameters and buffers (as DDP does), cast to `precision.param`;
    - `loss_fn(model, batch) -> (loss_sum, valid_tokens)`: the summed per-token losses of the
      rows it is given (a scalar tensor) and how many tokens they count;
    - `optimizer_fn(params)` builds the optimizer over the laid-out parameters (default: the
      spec's `optimizer.name`); the spec's schedule sets every group's `lr` before each update,
      and gradients are clipped to `optimizer.grad_clip_norm`, unless `spec_schedule=False`:
      then the optimizer keeps its own learning rate and nothing is clipped (`trainspec train
      --model` with a model that brings its optimizer, as on JAX);
    - `fsdp_units`: module-name rules for FSDP2 units (default: the children of the outermost
      nn.ModuleLists); `tensor_plan`: {module name: ParallelStyle} (default: by nn.Linear names);
    - `autocast`: the forward and the loss run under torch.autocast(`precision.compute`) when it
      is not the parameter dtype; False for a model that applies it itself;
    - `nan_guard`: the spec's `health.nan` policy decides each step (else every update is taken);
    - `pipeline_io`: with a split pipeline axis, what the stages take of a batch and how the
      last one computes the loss (trainspec.torch.pipeline.PipelineIO); the model cuts itself
      to a stage's part with `keep_stage(layers, first, last)`.

    `step(batch)` takes a dict of arrays (NumPy or torch) holding the global batch or this
    rank's rows of it (`step.rows()`), and returns the step's global metrics.
    """

    def __init__(self, model_fn: Callable[[], nn.Module], loss_fn: Callable, spec: Spec, *,
                 mesh: DeviceMesh, device: torch.device, optimizer_fn: Callable | None = None,
                 total_steps: int | None = None, fsdp_units: Sequence[str] | None = None,
                 tensor_plan: dict | None = None, autocast: bool = True, nan_guard: bool = True,
                 spec_schedule: bool = True, pipeline_io: PipelineIO | None = None):
        self.dims = check_layout(spec, mesh.size())  # what everything below reads of the mesh
        check_mesh(mesh, self.dims.shape)
        self.spec, self.mesh, self.device, self.loss_fn = spec, mesh, device, loss_fn
        self.total_steps = total_steps or spec.train.steps
        p = spec.precision
        self.param_dtype, self.grad_dtype = TORCH_DTYPES[p.param], TORCH_DTYPES[p.grad_reduce]
        self.compute_dtype = TORCH_DTYPES[p.compute]
        self.autocast = autocast and self.compute_dtype != self.param_dtype
        if self.autocast and self.compute_dtype not in SIXTEEN_BIT:
            raise UserInputError(
                f"precision.compute: {p.compute} is wider than precision.param {p.param}; "
                "torch.autocast computes in a 16-bit dtype only (or wrap(autocast=False) for a "
                "model that casts itself)")
        context = self.dims.split("context")
        self.context = ContextSplit(spec, mesh, context) if context else None
        self.model = build_model(model_fn, spec.seed, device, self.param_dtype,
                                 self.context.attention if self.context else None)
        # a split pipeline axis: this rank keeps its stage's part (trainspec/torch/pipeline.py)
        self.pipeline = stage_pipeline(spec, self.dims, mesh, device, self.model, pipeline_io)

        self.data_axes, fsdp, tensor = (self.dims.split(role) for role in ("data", "fsdp", "tensor"))
        self.batch_axes = batch_axes(self.dims)
        if tensor_plan is not None:  # checked on any mesh, so a typo shows before it matters
            check_rules_match(self.model, tensor_plan, "tensor_plan")
        if tensor:
            plan = tensor_plan or default_tensor_plan(self.model, self.dims.tensor)
            apply_tensor_parallel(self.model, mesh[tensor[0]], plan)
        expert = self.dims.split("expert")
        experts = lay_out_experts(self.model, mesh, routing_of(mesh, self.batch_axes, context),
                                  expert[0] if expert else None)
        units = shard_units(self.model, fsdp_units)  # checked on any mesh
        apply_remat(self.model, units, spec.remat.policy)  # inside FSDP2's hooks
        if fsdp:  # with virtual pipeline stages, a root per chunk (trainspec/torch/pipeline.py)
            roots = self.pipeline.fsdp_roots(units) if self.pipeline else [(self.model, units)]
            for root, held in roots:
                apply_fsdp(root, held, mesh[fsdp[0]], self.grad_dtype, ignored=experts)
        self.fsdp = bool(fsdp)
        if self.pipeline is not None:
            self.pipeline.start(self.model)
        self.data_group = group_of(mesh, self.data_axes) if self.data_axes else None
        # [semi_sync]: each data group steps on its own rows, nothing crosses the data axes
        # but the outer step (trainspec/torch/semi_sync.py)
        # (and the pipeline's stages: the last one holds the loss)
        summed = tuple(a for a in self.dims.names if a in self.dims.split("pipeline") or (
            a in token_axes(self.dims) and (spec.semi_sync is None or a not in self.data_axes)))
        self.batch_group = group_of(mesh, summed) if summed else None
        self.shards = self.dims.size_of(self.batch_axes)
        self._rows = rows(mesh, self.batch_axes, spec.batch.global_batch)
        self.norms = Norms(mesh, device, self.dims.split("pipeline"))
        # metrics.gns: a replica's tokens are on its other axes (fsdp, context)
        replica_axes = tuple(a for a in token_axes(self.dims) if a not in self.data_axes)
        self.noise_scale = StepNoiseScale(
            spec.metrics.gns if spec.semi_sync is None and self.pipeline is None else False,
            self.dims.replicas, spec.batch.accumulation_steps,
            self.norms, self.data_group,
            group_of(mesh, replica_axes) if replica_axes else None)
        if spec.semi_sync is not None:
            self.noise_scale.note = "semi_sync: no gradient is reduced across groups"
        if self.pipeline is not None:  # (true is refused: trainspec/torch/capabilities.py)
            self.noise_scale.note = "a split pipeline axis: the torch step does not measure it"

        self.params = list(self.model.parameters())
        # the experts' kernels are whole on the fsdp ranks, each of which routed its own rows
        spread = tuple(a for a in self.dims.names
                       if a in context + expert + (fsdp if expert else ()))
        self.spread = ReplicatedSum(mesh, spread, self.model.named_parameters()) \
            if spread else None
        self.reduction = self.overlapped = None
        self.outer = OuterStep(spec.semi_sync, self.params, self.data_group) \
            if spec.semi_sync is not None else None
        if self.data_group is not None and self.outer is None:
            # the replicated sum over context and expert ranks precedes the data reduction; a
            # pipeline's schedule runs m backwards, none of which alone completes a gradient
            if (self.fsdp or spec.collectives.compression != "none" or self.spread is not None
                    or self.pipeline is not None):
                self.reduction = DataReduction(spec.collectives, self.data_group,
                                               self.grad_dtype, self.model.named_parameters(),
                                               self.packing_order)
            else:  # DDP's overlap; the step's scalars ride in it where they sum over the same axes
                self.overlapped = OverlappedReduction(self.data_group, self.grad_dtype,
                                                      self.params)
        self.scalars_ride = self.overlapped is not None and summed == self.data_axes
        optimizer = (spec_optimizer(spec.optimizer, self.params) if optimizer_fn is None
                     else optimizer_fn(self.params))
        check_optimizer(optimizer, self.model)
        sharded = spec.layout.optimizer_state == "shard_over_data"
        if sharded:  # refused on any mesh, not only where it shards
            check_shardable(optimizer)
        shard_group = self.data_group if sharded else None
        residual = self.reduction.residual_state() if self.reduction else None
        self.optimizer = optimizer  # as built, unless its state is split or has company
        if shard_group is not None or residual is not None:
            self.optimizer = StepOptimizer(optimizer, shard_group, residual)
        self.update = DeviceUpdate(self.optimizer, spec.optimizer if spec_schedule else None,
                                   device)
        self.nan_guard = nan_guard
        self.guard = DeviceGuard(spec.health.nan, device)
        self._loss_checked = False

    @property
    def updates(self) -> int:
        """The updates applied (read on the host: at checkpoints)."""
        return int(self.update.count)

    @updates.setter
    def updates(self, value: int) -> None:
        self.update.count.fill_(value)

    def learning_rate(self, updates: int) -> float:
        """The learning rate of update `updates`: the spec's schedule over the run length, or
        the optimizer's own (its first group's) without `spec_schedule`."""
        return self.update.learning_rate(updates, self.total_steps)

    # The order of the data all-reduce's buffer (trainspec/torch/reduction.py); compression's
    # blocks and chunks are cut in it.
    packing_order = staticmethod(model_order)

    def rows(self) -> slice:
        """This rank's rows of the global batch."""
        return self._rows

    @property
    def gns_source(self) -> str | None:
        """Where metrics.gns's small batch comes from (`gns_source` in records), or None."""
        return self.noise_scale.source

    @property
    def gns_note(self) -> str | None:
        """Why the gradient noise scale is not measured (None when it is)."""
        return self.noise_scale.note

    @property
    def mesh_shape(self) -> dict[str, int]:
        return self.dims.shape

    @property
    def stage_group(self):
        """The pipeline axis's process group (None without a pipeline): its ranks hold the
        other stages' parameters."""
        return self.pipeline.group if self.pipeline is not None else None

    # -- the step ------------------------------------------------------------------------------
    def __call__(self, batch: Mapping, apply: Callable[[bool], bool] | None = None) -> dict:
        """One step; its global metrics as host numbers. `apply(finite)`, when given, decides
        whether the update is taken in place of the step's own guard (a loop that runs the
        policy itself); every rank reaches the same decision from the same global loss and
        gradient norm. Raises HealthHalt when the guard trips (the model keeps the last good
        step's state). A loop that reads metrics only now and then calls `device_step`."""
        if apply is not None:
            decide = lambda finite: torch.as_tensor(apply(bool(finite)), device=self.device)
        else:
            decide = self.guard if self.nan_guard else None
        metrics = to_host(self.device_step(batch, decide))
        if self.nan_guard and apply is None:
            metrics["skipped_steps"] = self.guard.check()
        return metrics

    def device_step(self, batch: Mapping,
                    decide: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
        """One step that reads nothing on the host: its metrics are tensors on the device
        (`to_host` reads them), and `decide(finite)` (a bool tensor to a bool tensor; None:
        every update is taken) decides on the device whether the update is applied
        (trainspec/torch/update.py: where that verdict is still read on the host)."""
        # the local blocks (a fused optimizer's zero_grad would mix DTensors and tensors)
        held = [local_block(q.grad) for q in self.params if q.grad is not None]
        if held:
            torch._foreach_zero_(held)
        sums, routing = self._accumulate(batch)
        if self.spread is not None:
            self.spread()
        grads = [q.grad for q in self.params if q.grad is not None]
        replica_part = self.noise_scale.replica_part(grads, sums[1])  # before the reduction
        if self.overlapped is not None:
            riding = sums if replica_part is None else torch.cat([sums, replica_part])
            summed = self.overlapped.finish(riding if self.scalars_ride else None)
            if self.scalars_ride:
                sums, replica_part = summed[:2], (summed[2:] if replica_part is not None else None)
        if self.reduction is not None:
            self.reduction()
        if self.batch_group is not None and not self.scalars_ride:
            dist.all_reduce(sums, group=self.batch_group)
        if replica_part is not None and not self.scalars_ride:
            dist.all_reduce(replica_part, group=self.data_group)
        small_batch = self.noise_scale.small_batch(replica_part)
        loss_sum, tokens = sums[0], sums[1]
        blocks = [local_block(g) for g in grads]
        if blocks:
            torch._foreach_div_(blocks, tokens.clamp(min=1.0))
        grad_norm = self.norms.norm(grads)
        finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
        take = decide(finite) if decide is not None else torch.ones((), dtype=torch.bool,
                                                                     device=self.device)
        lr = self.update(blocks, grad_norm, take, self.total_steps)
        if self.reduction is not None:
            self.reduction.commit(take)
        metrics = {"loss": loss_sum.double() / tokens.clamp(min=1.0).double(),
                   "grad_norm": grad_norm, "learning_rate": lr,
                   "valid_tokens": torch.where(take, tokens, 0.0), "nonfinite": (~finite).int(),
                   **self.noise_scale.parts(small_batch, grad_norm, tokens)}
        if routing:  # the experts' statistics, summed over micro-batches (as JAX's aux)
            metrics["aux"] = {name: value.detach() for name, value in routing.items()}
        if self.outer is not None:  # this group's values: the run combines the groups'
            metrics["loss_tokens"] = tokens
            self.outer.after_inner_step()
        return metrics


def to_host(tree):
    """A step's metrics (a tree of dicts, lists and tuples) with every tensor read as a host
    number: a record's one synchronisation."""
    if isinstance(tree, torch.Tensor):
        return tree.tolist()
    if isinstance(tree, dict):
        return {k: to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_host(v) for v in tree)
    return tree
