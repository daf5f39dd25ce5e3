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
"""
from __future__ import annotations

import contextlib
import inspect
import struct
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainspec.core.collectives_reference import to_groups
from trainspec.core.errors import UserInputError
from trainspec.core.health import ReplicaMismatch, odd_copies
from trainspec.core.spec import Spec
from trainspec.torch.mesh import group_of
from trainspec.torch.runtime import TORCH_DTYPES, TorchRuntime, fingerprint
from trainspec.torch.checkpoint import TorchCheckpointer
from trainspec.torch.context import ContextSplit
from trainspec.torch.gns import StepNoiseScale
from trainspec.torch.guard import DeviceGuard
from trainspec.torch.layout import (
    apply_fsdp, apply_tensor_parallel, check_rules_match, default_tensor_plan, local_block, rows,
    shard_units)
from trainspec.torch.norms import Norms
from trainspec.torch.models.moe import lay_out_experts, routing_stats, weighted_aux_loss
from trainspec.torch.optim import spec_optimizer
from trainspec.torch.optimizer_state import StepOptimizer, check_shardable
from trainspec.torch.overlap import OverlappedReduction
from trainspec.torch.pipeline import PipelineIO, stage_pipeline
from trainspec.torch.reduction import DataReduction, model_order, packed
from trainspec.torch.remat import apply_remat
from trainspec.torch.replicated import ReplicatedSum
from trainspec.torch.semi_sync import OuterStep
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


class WrappedStep:
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
        _check_mesh(mesh, self.dims.shape)
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
        self.model = self._build(model_fn)
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
        lay_out_experts(self.model, mesh, group_of(mesh, self.batch_axes)
                        if self.batch_axes else None, expert[0] if expert else None)
        units = shard_units(self.model, fsdp_units)  # checked on any mesh
        apply_remat(self.model, units, spec.remat.policy)  # inside FSDP2's hooks
        if fsdp:
            apply_fsdp(self.model, units, mesh[fsdp[0]], self.grad_dtype)
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
        spread = tuple(a for a in self.dims.names if a in context + expert)
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
        _check_optimizer(optimizer, self.model)
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

    def _build(self, model_fn) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.spec.seed)
            model = model_fn() if self.context is None else _with_attention(
                model_fn, self.context.attention)
        if not isinstance(model, nn.Module):
            raise UserInputError(f"model_fn: returned a {type(model).__name__}, not a "
                                 "torch.nn.Module")
        model.to(device=self.device, dtype=self.param_dtype)
        if dist.get_world_size() > 1:
            for tensors in _by_dtype([*model.parameters(), *model.buffers()]).values():
                packed(tensors, lambda flat: dist.broadcast(flat, src=0))
        return model

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

    def _accumulate(self, batch: Mapping) -> tuple[torch.Tensor, dict]:
        """Gradients of the summed token losses over k micro-batches (rows j, j+k, ... of this
        rank's rows); (loss sum, valid tokens) of this rank, and the MoE layers' routing
        statistics summed over the micro-batches ({} without experts). With MoE layers
        (trainspec.torch.models.moe) their auxiliary losses join the loss sum."""
        k = self.spec.batch.accumulation_steps
        local = self._local_rows(batch)
        sums = torch.zeros(2, dtype=torch.float32, device=self.device)
        every = self.noise_scale.every_micro_batch
        routing: dict = {}
        for j in range(k):
            micro = {key: v[j::k] for key, v in local.items()}
            if self.pipeline is not None:  # forwards and backwards by the stages' schedule
                with self._compute():
                    loss_sum, tokens = self.pipeline.run(micro)
                sums += torch.stack([loss_sum, tokens])
                continue
            if self.fsdp:  # reduce-scatter once, after the last micro-batch (or after each)
                self.model.set_requires_gradient_sync(every or j == k - 1)
            if self.overlapped is not None and j == k - 1:  # this backward completes them
                self.overlapped.arm()
            with self._compute():
                loss_sum, tokens = self._loss(micro)
                stats = routing_stats(self.model)
                if stats is not None:
                    loss_sum = loss_sum + weighted_aux_loss(self.model, tokens)
                    routing = {n: routing.get(n, 0) + v for n, v in stats.items()}
            loss_sum.backward()
            tokens = torch.as_tensor(tokens, device=self.device).float()
            sums += torch.stack([loss_sum.detach().float(), tokens])
            if every:
                self.noise_scale.after_micro_batch(
                    [q.grad for q in self.params if q.grad is not None], tokens)
        return sums, routing

    def evaluate(self, batch: Mapping) -> tuple[float, float]:
        """(loss sum, valid tokens) of `loss_fn` over the global batch (this rank's rows, or the
        whole batch), the model in eval mode, no gradient: `[eval]`'s held-out loss."""
        k, local = self.spec.batch.accumulation_steps, self._local_rows(batch)
        sums = torch.zeros(2, dtype=torch.float32, device=self.device)
        self.model.eval()
        try:
            with torch.no_grad():
                for j in range(k):
                    micro = {key: v[j::k] for key, v in local.items()}
                    with self._compute():
                        if self.pipeline is not None:
                            loss_sum, tokens = self.pipeline.evaluate(micro)
                        else:
                            loss_sum, tokens = self.loss_fn(self.model, micro)
                        if routing_stats(self.model) is not None:
                            loss_sum = loss_sum + weighted_aux_loss(self.model, tokens)
                    tokens = torch.as_tensor(tokens, device=self.device).float()
                    sums += torch.stack([loss_sum.float(), tokens])
        finally:
            self.model.train()
        if self.batch_group is not None:
            dist.all_reduce(sums, group=self.batch_group)
        loss_sum, tokens = sums.tolist()
        return loss_sum, tokens

    def _compute(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _loss(self, micro: dict):
        result = self.loss_fn(self.model, micro)
        if not self._loss_checked:
            ok = (isinstance(result, tuple) and len(result) == 2
                  and isinstance(result[0], torch.Tensor) and result[0].dim() == 0
                  and result[0].requires_grad)
            if not ok:
                raise UserInputError(
                    "loss_fn: expected (loss_sum, valid_tokens), the summed per-token losses as "
                    "a scalar tensor that requires grad and the token count; got "
                    f"{_describe(result)}")
            self._loss_checked = True
        return result

    def _local_rows(self, batch: Mapping) -> dict[str, torch.Tensor]:
        if not isinstance(batch, Mapping):
            raise UserInputError(f"batch: expected a dict of arrays, got a {type(batch).__name__}")
        whole, per = self.spec.batch.global_batch, self._rows.stop - self._rows.start
        local = {}
        for key, value in batch.items():
            t = torch.as_tensor(value)
            n = t.shape[0] if t.dim() else 0
            if n not in (whole, per):
                raise UserInputError(
                    f"batch[{key!r}] has {n} rows; expected batch.global_batch = {whole} (the "
                    f"global batch) or {per} (this rank's rows, step.rows())")
            local[key] = (t[self._rows] if n != per else t).to(self.device)
        return local if self.context is None else self.context.local(local)

    # -- health and checkpoints ----------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """This rank's blocks of everything its checkpoints carry: the parameters, the
        optimizer's state, the error-feedback residual and semi_sync's anchor and momentum."""
        optimizer = [v for per_param in self.optimizer.state.values() for v in per_param.values()
                     if torch.is_tensor(v)]
        compressed = self.reduction.compressed if self.reduction is not None else None
        residual = [compressed.residual] if compressed and compressed.residual is not None else []
        outer = [*self.outer.anchor, *self.outer.momentum] if self.outer is not None else []
        return [local_block(t) for t in (*self.params, *optimizer, *residual, *outer)]

    def check_replicas(self, step: int, last_good_step: int = 0,
                       ids: list[int] | None = None) -> None:
        """Fingerprint every parameter's local block; the copies across the data axes must
        agree. ReplicaMismatch names the first parameter whose copies differ and the ranks the
        core's majority vote finds odd in any data group: the fingerprints are gathered from
        every rank, so that every rank raises the same (a rollback re-forms the job on all).
        `ids[rank]`: how to name a rank (default: by its rank; a run names the ranks of the
        job as launched)."""
        if self.data_group is None:
            return
        # under [semi_sync] the groups agree on the anchor (their own parameters differ
        # between outer steps)
        blocks = self.outer.anchor if self.outer else [local_block(q.detach()) for q in self.params]
        mine = [fingerprint(block) for block in blocks]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        names = [name for name, _ in self.model.named_parameters()]
        odd, first = set(), None
        for ranks in self._data_groups():
            for i, name in enumerate(names):
                diverged = odd_copies([struct.pack("<II", *every[r][i]) for r in ranks])
                if diverged:
                    odd.update(ranks[j] for j in diverged)
                    first = first or name
                    break
        if odd:
            named = sorted(ids[r] if ids else r for r in odd)
            raise ReplicaMismatch(f"replica fingerprints differ after step {step}: {first} on "
                                  f"ranks {named}", last_good_step, named)

    def _data_groups(self) -> list[list[int]]:
        """The global ranks of each data group (the copies of the same blocks)."""
        grid = self.mesh.mesh.numpy()
        names = list(self.mesh.mesh_dim_names)
        members, _ = to_groups(grid, grid.ndim, tuple(names.index(a) for a in self.data_axes))
        return members.tolist()

    def save(self, checkpointer: TorchCheckpointer, step: int) -> None:
        """Checkpoint the state after `step` (its data position), replicas checked first."""
        self.check_replicas(step, checkpointer.last_saved or 0)
        counts = self.guard.counts()
        checkpointer.save(step, self.model, self.optimizer, self.total_steps, self.updates,
                          counts["skipped_steps"], self.mesh_shape,
                          counts["consecutive_nonfinite"], outer=self.outer)

    def restore(self, checkpointer: TorchCheckpointer) -> int:
        """Load the newest checkpoint, resharded onto this layout (any mesh); the data position
        to continue from (0 when there is none). The schedule keeps the saved run's length."""
        meta = checkpointer.restore_latest(self.model, self.optimizer, self.outer)
        if meta is None:
            return 0
        if self.outer is not None:
            self.outer.steps_done = meta["data_position"]
        self.total_steps, self.updates = meta["total_steps"], meta["updates"]
        self.guard = DeviceGuard(self.spec.health.nan, self.device, meta["data_position"],
                                 meta["skipped_steps"], meta.get("consecutive_nonfinite", 0))
        return meta["data_position"]


def _check_mesh(mesh: DeviceMesh, sizes: dict[str, int]) -> None:
    have = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape))
    if have != sizes:
        raise UserInputError(f"mesh: its axes {have} are not the spec's mesh.axes {sizes} on "
                             f"{mesh.size()} ranks")


def _check_optimizer(optimizer, model: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserInputError(f"optimizer_fn: returned a {type(optimizer).__name__}, not a "
                             "torch.optim.Optimizer")
    held = {id(q) for group in optimizer.param_groups for q in group["params"]}
    missing = [n for n, q in model.named_parameters() if q.requires_grad and id(q) not in held]
    if missing:
        raise UserInputError(
            f"optimizer_fn: {len(missing)} trainable parameters are not in its optimizer (first: "
            f"{missing[0]}); build it from the parameters it is given, which are laid out")


def _describe(value) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}: ({', '.join(_describe(v) for v in value)})"
    if isinstance(value, torch.Tensor):
        grad = ", no grad" if not value.requires_grad else ""
        return f"a tensor of shape {tuple(value.shape)}{grad}"
    return f"a {type(value).__name__}"


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _with_attention(model_fn: Callable, attention: Callable) -> nn.Module:
    """`model_fn(attention=...)` under a split context axis: the model attends through the
    context ranks (trainspec.torch.context.ContextSplit.attention), or it would see its own
    part of each sequence only."""
    if "attention" not in inspect.signature(model_fn).parameters:
        raise UserInputError(
            "mesh.axes.context: a split context axis needs a model_fn that takes `attention`, "
            "the causal attention of (batch, heads, length, head_dim) tensors across the context "
            "ranks, and uses it in place of its own (docs/adapters.md)")
    return model_fn(attention=attention)


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
