"""The spec's train step in PyTorch: layout onto the DeviceMesh, token-weighted accumulation,
precision, clipping and the optimizer as `trainspec train` (JAX, optax) defines them.

Layout (docs/adapters.md):
- `data` axes: every rank holds whole parameters; the summed gradients are all-reduced over the
  data group once per step, packed into one buffer (as the JAX step fuses them);
- `fsdp` axis: FSDP2 `fully_shard` of each block and the root on that sub-mesh; its
  reduce-scatter sums (divide factor 1) so that the one division by the token count stays ours;
- `tensor` axis: DTensor ColwiseParallel on query/key/value/mlp_in and the vocabulary head,
  RowwiseParallel on out/mlp_out (Megatron's split); the embedding table stays replicated.
The batch is split over the data and fsdp axes, row-major, as in the JAX layout's default rule.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from trainspec.torch.adapter import TORCH_DTYPES as DTYPES, axes_size, group_of
from trainspec.torch.model import Transformer, next_token_loss
from trainspec.torch.support import check_spec
from trainspec.core.spec import OptimizerSpec, Spec


def learning_rate(o: OptimizerSpec, total_steps: int, count: int) -> float:
    """The learning rate of update number `count` (0-based): linear warm-up from 0, then cosine
    decay to a tenth, exactly the schedule trainspec.jax.train.make_optimizer builds with optax."""
    warmup = max(1, min(o.warmup_steps, total_steps - 1))
    decay = max(total_steps, 2)
    if count < warmup:
        return o.learning_rate * count / warmup
    alpha = 0.1
    t = min(count - warmup, decay - warmup) / (decay - warmup)
    return o.learning_rate * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * t)) + alpha)


def _size(mesh: DeviceMesh, axis: str) -> int:
    return mesh.size(mesh.mesh_dim_names.index(axis))


def _apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)

    plan = {"query": ColwiseParallel(), "key": ColwiseParallel(), "value": ColwiseParallel(),
            "out": RowwiseParallel(), "mlp_in": ColwiseParallel(), "mlp_out": RowwiseParallel()}
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, plan)
    parallelize_module(model, tp_mesh, {"head": ColwiseParallel(output_layouts=Replicate())})


def _apply_fsdp(model: Transformer, fsdp_mesh: DeviceMesh, reduce_dtype: torch.dtype) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    # With a tensor axis too, the root's output is the head's DTensor.to_local(), a view, and
    # FSDP2 warns (on every rank) that an in-place op on it would skip its backward hook. The
    # loss reads the logits out of place only, so the warning says nothing about this model.
    warnings.filterwarnings("ignore", category=UserWarning,
                            message=r"FSDP2-wrapped module \(FSDPTransformer\) returned a view")
    for block in model.blocks.values():
        fully_shard(block, mesh=fsdp_mesh, mp_policy=policy)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)  # sum: we divide by the tokens once
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def sharded_axes(t: DTensor) -> tuple[str, ...]:
    """The mesh axes over which `t`'s local blocks are disjoint pieces of it.

    Every placement but Replicate splits the tensor: Shard, and also _StridedShard, which FSDP2
    gives a parameter that tensor parallelism already split on the same dimension (fsdp x
    tensor). Since torch 2.13 `_StridedShard.is_shard()` is False and it no longer subclasses
    Shard, so asking `is_shard()` dropped the fsdp axis from those parameters' norms. A Partial
    placement holds unreduced addends, whose squares do not sum to the square of their sum."""
    if any(p.is_partial() for p in t.placements):
        raise ValueError(f"a gradient with pending reductions ({t.placements}) has no local norm")
    return tuple(name for name, p in zip(t.device_mesh.mesh_dim_names, t.placements)
                 if not p.is_replicate())


def local_block(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of a parameter or gradient (all of it when not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


class TorchStep:
    """Model, optimizer and the step of one rank. `__call__(rows)` takes this rank's rows of the
    global batch (`rows()` says which) and returns the step's global metrics."""

    def __init__(self, spec: Spec, mesh: DeviceMesh, total_steps: int, device: torch.device,
                 initial_params: dict | None = None):
        check_spec(spec, mesh.size())
        self.spec, self.mesh, self.total_steps, self.device = spec, mesh, total_steps, device
        p = spec.precision
        self.grad_dtype = DTYPES[p.grad_reduce]
        self.model = Transformer(spec.model, DTYPES[p.compute], DTYPES[p.param])
        if initial_params is None:
            self.model.init_weights(spec.seed)
        else:  # e.g. a JAX run's initial parameters, through NumPy (torch_model.from_flax)
            self.model.load_state_dict(initial_params)
        self.model.to(device)
        axes = lambda role: tuple(a for a in spec.mesh.axes_with_role(role) if _size(mesh, a) > 1)  # noqa: E731
        self.data_axes, fsdp, tensor = axes("data"), axes("fsdp"), axes("tensor")
        self.batch_axes = tuple(a for a in mesh.mesh_dim_names if a in self.data_axes + fsdp)
        if tensor:
            _apply_tensor_parallel(self.model, mesh[tensor[0]])
        if fsdp:
            _apply_fsdp(self.model, mesh[fsdp[0]], self.grad_dtype)
        self.fsdp = bool(fsdp)
        self.data_group = group_of(mesh, self.data_axes) if self.data_axes else None
        self.batch_group = group_of(mesh, self.batch_axes) if self.batch_axes else None
        self.shards = axes_size(mesh, self.batch_axes)
        self.params = [q for q in self.model.parameters()]
        o = spec.optimizer
        if o.name == "adamw":  # optax.adamw's defaults: b1 0.9, b2 0.999, eps 1e-8
            self.optimizer = torch.optim.AdamW(self.params, lr=0.0, betas=(0.9, 0.999), eps=1e-8,
                                               weight_decay=o.weight_decay)
        else:  # optax.sgd(momentum=0.9): trace g + 0.9 trace, no dampening
            self.optimizer = torch.optim.SGD(self.params, lr=0.0, momentum=0.9)
        self._groups: dict[tuple[str, ...], object] = {}  # process groups of sharded axes
        self.updates = 0  # applied updates: the schedule's count (a skipped step adds none)

    # -- the batch ---------------------------------------------------------------------------
    def rows(self) -> slice:
        """This rank's rows: block `shard` of the batch axes' row-major coordinates."""
        shard = 0
        for axis in self.batch_axes:
            shard = shard * _size(self.mesh, axis) + self.mesh.get_local_rank(axis)
        per = self.spec.batch.global_batch // self.shards
        return slice(shard * per, (shard + 1) * per)

    # -- the step ------------------------------------------------------------------------------
    def _accumulate(self, rows: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of the summed token losses over k micro-batches (rows j, j+k, ...),
        and (loss sum, valid tokens) of this rank."""
        k = self.spec.batch.accumulation_steps
        batch = {key: torch.from_numpy(v).to(self.device) for key, v in rows.items()}
        sums = torch.zeros(2, dtype=torch.float32, device=self.device)
        for j in range(k):
            if self.fsdp:  # reduce-scatter once, after the last micro-batch
                self.model.set_requires_gradient_sync(j == k - 1)
            micro = {key: v[j::k] for key, v in batch.items()}
            loss_sum, tokens = next_token_loss(self.model(micro["inputs"]), micro["targets"],
                                               micro["mask"])
            loss_sum.backward()
            sums += torch.stack([loss_sum.detach().float(), tokens.float()])
        return sums

    def _reduce_over_replicas(self) -> None:
        """One all-reduce (sum) of every local gradient, packed into one buffer."""
        grads = [local_block(q.grad) for q in self.params]
        flat = torch.cat([g.reshape(-1).to(self.grad_dtype) for g in grads])
        dist.all_reduce(flat, group=self.data_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def _grad_norm(self) -> torch.Tensor:
        """Global L2 norm: squares of the local shards summed per set of sharded mesh axes,
        one all-reduce per set (a replicated dimension is counted once)."""
        by_axes: dict[tuple[str, ...], torch.Tensor] = {}
        for q in self.params:
            g, axes = q.grad, ()
            if isinstance(g, DTensor):
                axes = sharded_axes(g)
                g = g.to_local()
            by_axes[axes] = by_axes.get(axes, 0.0) + g.float().pow(2).sum()
        total = torch.zeros((), dtype=torch.float32)
        for axes, square in by_axes.items():
            if axes:
                if axes not in self._groups:
                    self._groups[axes] = group_of(self.mesh, axes)
                dist.all_reduce(square, group=self._groups[axes])
            total += square
        return torch.sqrt(total)

    def __call__(self, rows: dict[str, np.ndarray],
                 apply: Callable[[bool], bool] = bool) -> dict[str, float]:
        """One step on this rank's rows. `apply(finite)` decides whether the update is taken
        (the non-finite policy); every rank reaches the same decision from the same global
        loss and gradient norm."""
        self.optimizer.zero_grad(set_to_none=False)
        sums = self._accumulate(rows)
        if self.data_group is not None:
            self._reduce_over_replicas()
        if self.batch_group is not None:
            dist.all_reduce(sums, group=self.batch_group)
        loss_sum, tokens = sums.tolist()
        denom = max(tokens, 1.0)
        for q in self.params:
            q.grad.div_(denom)
        grad_norm = float(self._grad_norm())
        finite = math.isfinite(loss_sum) and math.isfinite(grad_norm)
        taken = apply(finite)
        if taken:
            self._update(grad_norm)
        return {"loss": loss_sum / denom, "grad_norm": grad_norm,
                "valid_tokens": tokens if taken else 0.0, "nonfinite": int(not finite)}

    def _update(self, grad_norm: float) -> None:
        clip = self.spec.optimizer.grad_clip_norm
        if clip is not None and grad_norm >= clip:  # optax.clip_by_global_norm
            for q in self.params:
                q.grad.div_(grad_norm).mul_(clip)
        lr = learning_rate(self.spec.optimizer, self.total_steps, self.updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.updates += 1
