"""Pipeline stages over the mesh's `pipeline` axis on torch (docs/pipeline.md), through
`torch.distributed.pipelining`.

Every decision is the trunk's (trainspec.core.pipeline): which layers each stage holds
(`stages.chunk_layers`: an even split, or `pipeline.layers_per_stage`; the embedding on the
first stage, the final norm and head on the last), which rows form each pipeline micro-batch
(`stages.microbatch_order`: micro-batch i holds rows i, i+m, ...), and the order of forwards
and backwards on each stage (`schedule.orders`). torch moves the bytes: a `PipelineStage` per
model chunk (one per rank; v under interleaved 1F1B) sends activations forward and their
gradients back over the pipeline axis's process group, and `CoreSchedule` runs the trunk's orders as they are, through torch's schedule
runtime (which adds the sends, receives and FSDP2's unshard, reshard and gradient
reduce-scatter around them), rather than torch's own schedule classes, whose orders are
torch's decisions (its GPipe, for one, runs the backwards first micro-batch first).

Each rank builds the whole model (rank 0's parameters), then keeps its stage's part
(`keep_stage`), which FSDP2 then lays out like the whole model; with v chunks per stage each
chunk runs a view of that part (`chunk_view`), which shares its parameters. The last
stage's loss of each pipeline micro-batch is its summed per-token loss (the schedule's
gradient scaling by 1/m is off), so the step's one division by the valid tokens of the whole
batch stays the accumulation rule's.

`ExecutedOrder` records what the schedule ran on this rank, one operation at a time, so that
the trunk's `schedule.check` and `schedule.execute` can verify it and measure its idle
fraction, and count the activations it holds and their bytes
(tests/torch/test_torch_pipeline_schedule.py).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    _Action, _ComputationType, _PipelineScheduleRuntime)

from trainspec.core.errors import UserInputError
from trainspec.core.mesh import ParallelDims, pipeline_microbatches
from trainspec.core.pipeline.schedule import BACKWARD, FORWARD, Op, orders
from trainspec.core.pipeline.stages import chunk_layers, microbatch_order
from trainspec.core.spec import Spec

KINDS = {FORWARD: _ComputationType.FORWARD, BACKWARD: _ComputationType.FULL_BACKWARD}


class CoreSchedule(_PipelineScheduleRuntime):
    """torch's schedule runtime on the trunk's per-stage orders: operation (kind, micro-batch i,
    local chunk c) of stage s is action (model chunk c·p + s, kind, i), chunk k on rank k mod p
    (torch's default placement, the trunk's looped one)."""

    def __init__(self, stages: list[PipelineStage], microbatches: int, loss_fn: Callable,
                 stage_orders: list[list[Op]]):
        super().__init__(stages=stages, n_microbatches=microbatches, loss_fn=loss_fn,
                         scale_grads=False)
        p = len(stage_orders)
        self.pipeline_order = {
            s: [_Action(op.chunk * p + s, KINDS[op.kind], op.microbatch) for op in ops]
            for s, ops in enumerate(stage_orders)}
        self._prepare_schedule_with_comms(self.pipeline_order)


class ExecutedOrder:
    """The operations a rank's stages ran, in order, with their wall-clock start and end, and
    after each the micro-batches whose activations the stage holds (its forward cache: kept
    from a forward until its backward).

    With `measure_bytes` set (off by default: it costs a Python call per saved tensor), also
    the bytes the stage holds for its backwards at the start of each operation and at the
    step's end (`held_bytes`, one more entry than `ops`): the tensors autograd saved
    (torch.autograd.graph.saved_tensors_hooks), the forward cache's inputs and outputs and the
    outputs the stage keeps for the step's end (none: `run` asks for none), each view once (a micro-batch's slice of the batch counts its own bytes), parameters
    (and views of them) left out."""

    def __init__(self, stages: list[PipelineStage], p: int, params: list[torch.Tensor]):
        self.ops: list[tuple[Op, float, float]] = []
        self.held: list[int] = []
        self.held_bytes: list[int] = []
        self.measure_bytes = False
        self.stages, self.params = stages, params
        self._saved: weakref.WeakSet = weakref.WeakSet()
        for stage in stages:
            chunk = stage.stage_index // p
            self._record(stage, "forward_one_chunk", FORWARD, chunk)
            self._record(stage, "backward_one_chunk", BACKWARD, chunk)

    def _record(self, stage: PipelineStage, method: str, kind: str, chunk: int) -> None:
        run = getattr(stage, method)

        def recorded(microbatch, *args, **kwargs):
            if self.measure_bytes:
                self.held_bytes.append(self._bytes_held())
            start = time.perf_counter()
            out = run(microbatch, *args, **kwargs)
            self.ops.append((Op(kind, microbatch, chunk), start, time.perf_counter()))
            self.held.append(sum(len(s.fwd_cache) for s in self.stages))
            return out

        setattr(stage, method, recorded)

    @contextlib.contextmanager
    def step(self):
        """Around one run of the schedule (one accumulation micro-batch): the record starts
        afresh, so it holds the last run's operations, not every step's; its saved tensors
        are tracked when measuring bytes."""
        self.clear()
        if not self.measure_bytes:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _Saved.unpack):
            yield
        self.held_bytes.append(self._bytes_held())

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)  # autograd holds it until the backward frees the graph
        self._saved.add(saved)
        return saved

    def _bytes_held(self) -> int:
        params = {p.untyped_storage().data_ptr() for p in self.params}
        cached = [t for stage in self.stages for entry in stage.fwd_cache.values()
                  for part in entry for t in part if isinstance(t, torch.Tensor)]
        cached += [t for stage in self.stages for t in stage.output_chunks
                   if isinstance(t, torch.Tensor)]
        views = {(t.data_ptr(), t.nbytes) for t in [*(s.tensor for s in self._saved), *cached]
                 if t.untyped_storage().data_ptr() not in params}
        return sum(nbytes for _, nbytes in views)

    def clear(self) -> None:
        self.ops.clear()
        self.held.clear()
        self.held_bytes.clear()


class _Saved:
    """A tensor autograd saved for a backward, as the graph holds it (weakly referenced by
    ExecutedOrder, so that it drops out once the graph is freed)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def unpack(self) -> torch.Tensor:
        return self.tensor


@dataclasses.dataclass(frozen=True)
class PipelineIO:
    """What a pipeline needs of a model's batch and loss: the first stage's `inputs(batch)`,
    the last stage's `target(batch)` (one tensor, rows first, cut into micro-batches like the
    inputs), `loss(output, target)`: the summed per-token loss of a micro-batch from the last
    stage's output, and `tokens(batch)`: the valid tokens of the rows."""

    inputs: Callable[[dict], torch.Tensor]
    target: Callable[[dict], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    tokens: Callable[[dict], torch.Tensor]


def stage_pipeline(spec: Spec, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
                   model: nn.Module, io: PipelineIO | None) -> StagePipeline | None:
    """This rank's stage of the pipeline over the split pipeline axis, `model` cut to its
    part (`model.keep_stage(layers, first, last)`); None without a split pipeline axis."""
    if dims.stages == 1:
        return None
    missing = [name for name, there in (("blocks", hasattr(model, "blocks")),
                                        ("keep_stage", hasattr(model, "keep_stage")),
                                        ("pipeline_io", io is not None)) if not there]
    if missing:
        raise UserInputError(
            f"mesh.axes.*.size: a split pipeline axis needs a model with blocks and "
            f"keep_stage, and a pipeline_io; missing {', '.join(missing)} "
            "(docs/wrapping.md, \"Pipeline\")")
    pipeline = StagePipeline(spec, dims, mesh, device, io, len(model.blocks))
    model.keep_stage(pipeline.layers(), pipeline.first, pipeline.last)
    count = pipeline.stages * pipeline.virtual
    pipeline.parts = [(pipeline.stage, model)] if pipeline.virtual == 1 else [
        (k, chunk_view(model, pipeline.chunks[k], k == 0, k == count - 1))
        for k in pipeline.chunk_ids()]
    return pipeline


class StagePipeline:
    """This rank's pipeline stage: its part of the model, and one accumulation micro-batch's
    forwards and backwards through the schedule (`run`)."""

    def __init__(self, spec: Spec, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
                 io: PipelineIO, n_layers: int):
        self.axis = dims.split("pipeline")[0]
        self.stages, self.stage = dims.stages, mesh.get_local_rank(self.axis)
        self.group = mesh.get_group(self.axis)
        self.device, self.io, section = device, io, spec.pipeline
        self.microbatches = pipeline_microbatches(spec, dims)
        self.virtual = section.virtual_stages
        self.chunks = chunk_layers(n_layers, self.stages * self.virtual, section.layers_per_stage)
        self.schedule_name = section.schedule
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.parts: list[tuple[int, nn.Module]] = []  # (model chunk, module running it)
        self.schedule: CoreSchedule | None = None
        self.executed: ExecutedOrder | None = None

    def chunk_ids(self) -> list[int]:
        """The model chunks this rank's stage runs: c·p + stage for each local chunk c."""
        return [c * self.stages + self.stage for c in range(self.virtual)]

    def layers(self) -> list[int]:
        """The blocks this rank's stage holds (those of all its chunks)."""
        return [layer for k in self.chunk_ids() for layer in self.chunks[k]]

    def fsdp_roots(self, units: list[str]) -> list[tuple[nn.Module, list[str]]]:
        """The modules FSDP2 shards as roots, each with the `units` (module names) it holds:
        the rank's part, or with virtual stages each chunk's view (a root per chunk: each
        chunk's forward unshards its own parameters, as torchtitan shards its model parts)."""
        def holds(part: nn.Module, name: str) -> bool:
            try:
                part.get_submodule(name)
            except AttributeError:
                return False
            return True

        return [(part, [name for name in units if holds(part, name)]) for _, part in self.parts]

    def start(self, model: nn.Module) -> None:
        """The schedule over `model`, this rank's part, laid out (FSDP2 applied); with
        virtual stages one PipelineStage per chunk, each running a view of `model`, whose
        own parameters (as sharded by its root) `model` takes back."""
        for _, part in self.parts:
            if part is not model:
                model._parameters.update(
                    (name, p) for name, p in part._parameters.items() if p is not None)
        count = self.stages * self.virtual
        stages = [PipelineStage(part, k, count, self.device, group=self.group)
                  for k, part in self.parts]
        stage_orders = orders(self.schedule_name, self.stages, self.microbatches, self.virtual)
        self.schedule = CoreSchedule(stages, self.microbatches, self.io.loss, stage_orders)
        self.executed = ExecutedOrder(stages, self.stages, list(model.parameters()))

    def run(self, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The forwards and backwards of one accumulation micro-batch (this rank's rows);
        (summed loss, valid tokens) of its pipeline micro-batches on the last stage, zeros
        on the others (the step sums the stages' values)."""
        target = self.io.target(micro)
        order = torch.tensor(microbatch_order(target.shape[0], self.microbatches),
                             device=target.device)
        losses: list[torch.Tensor] = []
        args = (self.io.inputs(micro)[order],) if self.first else ()
        with self.executed.step():  # the outputs are not kept: each micro-batch's logits
            # would be held on the last stage until the step's end, whatever the schedule
            self.schedule.step(*args, target=target[order], losses=losses, return_outputs=False)
        zero = torch.zeros((), device=self.device)
        if not self.last:
            return zero, zero
        loss_sum = torch.stack([loss.detach().float() for loss in losses]).sum()
        return loss_sum, torch.as_tensor(self.io.tokens(micro), device=self.device).float()

    def evaluate(self, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """`run`'s sums for a forward only (no gradient), the rows whole: each chunk takes the
        previous chunk's activations (from the previous stage), runs and hands them on."""
        last = self.stages * self.virtual - 1
        zero = torch.zeros((), device=self.device)
        for k, part in self.parts:
            if k == 0:
                x = self.io.inputs(micro)
            else:
                received = [None]
                dist.recv_object_list(received, group=self.group,
                                      group_src=(self.stage - 1) % self.stages,
                                      device=self.device)
                x = received[0].to(self.device)
            with torch.no_grad():
                y = part(x)
            if k == last:
                loss_sum = self.io.loss(y, self.io.target(micro)).float()
                return loss_sum, torch.as_tensor(self.io.tokens(micro), device=self.device).float()
            dist.send_object_list([y], group=self.group, group_dst=(self.stage + 1) % self.stages,
                                  device=self.device)
        return zero, zero


def chunk_view(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """A module that runs one chunk of `model` (a stage's part: its blocks of several chunks)
    with `model`'s own parameters: a shallow copy with tables of its own (modules, parameters,
    buffers, and `blocks`'s modules), cut by the model's `keep_stage`, so that the same
    parameter objects gather every chunk's gradients and the optimizer, checkpoints and the
    data reduction see `model` alone."""
    view = copy.copy(model)
    for table in ("_modules", "_parameters", "_buffers"):
        setattr(view, table, dict(getattr(model, table)))
    blocks = copy.copy(model.blocks)
    blocks._modules = dict(model.blocks._modules)
    name = next(n for n, child in model.named_children() if child is model.blocks)
    view._modules[name] = blocks
    view.keep_stage(layers, first, last)
    return view
