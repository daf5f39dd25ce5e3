"""The communication volume of a torch step (docs/metrics.md section 5): every collective one
step issues on this rank, seen at torch's dispatcher while the step runs: torch.distributed's
own (`c10d.*`: the data all-reduce, FSDP2's all-gathers and reduce-scatters, ZeRO-1's
all-gather, the compression's and the experts' all-to-alls, the point-to-point sends of the
context ring and of the pipeline's stages) and DTensor's functional ones
(`_c10d_functional.*`: tensor parallelism), forward and backward (the backward of CPU tensors
runs in the calling thread, where the counting mode is active).

Each contributes its payload S in nccl-tests' convention (the buffer for all-reduce, all-to-all
and broadcast; the gathered output for all-gather; the unscattered input for reduce-scatter),
by kind and by the mesh axes its group spans, and S x the bus factor to the bus bytes. A send
counts as a `collective-permute` of its buffer, the kind XLA gives JAX's ring and pipeline
moves (each rank counts what it sends, so a receive counts nothing).
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

BUS_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
              "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0, "collective-permute": lambda n: 1.0}

# operator -> (kind, which argument holds the payload S)
C10D = {"allreduce_": ("all-reduce", 0), "allreduce_coalesced_": ("all-reduce", 0),
        "_allgather_base_": ("all-gather", 0), "allgather_": ("all-gather", 0),
        "allgather_into_tensor_coalesced_": ("all-gather", 0),
        "_reduce_scatter_base_": ("reduce-scatter", 1), "reduce_scatter_": ("reduce-scatter", 1),
        "reduce_scatter_tensor_coalesced_": ("reduce-scatter", 1),
        "alltoall_base_": ("all-to-all", 0), "alltoall_": ("all-to-all", 0),
        "broadcast_": ("broadcast", 0), "send": ("collective-permute", 0)}
FUNCTIONAL = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
              "reduce_scatter_tensor": "reduce-scatter", "all_to_all_single": "all-to-all",
              "broadcast": "broadcast"}


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(y) for y in x)
    return 0


class CommCounter(TorchDispatchMode):
    """While entered, adds up the collectives this rank issues; `volume(axes_of)` then gives
    the record's comm fields. `axes_of(ranks)`: the mesh axes a group of global ranks spans."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int, tuple[int, ...]]] = []  # (kind, S, group's ranks)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func.name().partition("::")
        name = name.split(".")[0]
        if namespace == "c10d" and name in C10D:
            kind, where = C10D[name]
            group = next(a for a in args if isinstance(a, torch.ScriptObject))
            self._add(kind, _bytes(args[where]), dist.ProcessGroup.unbox(group))
        elif namespace == "_c10d_functional" and name in FUNCTIONAL:
            group = _resolve_process_group(args[-1])
            size = _bytes(args[0]) * (group.size() if name == "all_gather_into_tensor" else 1)
            self._add(FUNCTIONAL[name], size, group)
        return func(*args, **(kwargs or {}))

    def _add(self, kind: str, size: int, group) -> None:
        self.calls.append((kind, size, tuple(dist.get_process_group_ranks(group))))

    def volume(self, axes_of, every: tuple | None = None, h: int = 1) -> dict:
        """comm_bytes_per_step, comm_bus_bytes_per_step, by kind and by axis. `every`: a call
        (kind, S, ranks) that runs once every `h` steps (the semi_sync outer step): counted
        1/h times per step, whether or not the counted step ran it."""
        calls = [(*call, 1.0) for call in self.calls if call != every]
        if every is not None:
            calls.append((*every, 1.0 / h))
        by_kind: dict[str, float] = {}
        by_axis: dict[str, float] = {}
        bus = 0.0
        for kind, size, ranks, times in calls:
            by_kind[kind] = by_kind.get(kind, 0) + size * times
            axes = axes_of(ranks)
            by_axis[axes] = by_axis.get(axes, 0) + size * times
            bus += size * times * BUS_FACTOR[kind](len(ranks))
        return {"comm_bytes_per_step": sum(by_kind.values()), "comm_bus_bytes_per_step": bus,
                "comm_bytes_by_kind": by_kind, "comm_bytes_by_axis": by_axis}


def mesh_axes_of(mesh) -> callable:
    """ranks -> the '+'-joined mesh axes (of `mesh`, a DeviceMesh) whose variation forms exactly
    that group of global ranks, '?' when none does (as the JAX records name them)."""
    grid = mesh.mesh
    names = list(mesh.mesh_dim_names)
    me = dist.get_rank()
    where = [int(c[0]) for c in torch.nonzero(grid == me, as_tuple=True)]
    spans = {}
    for n in range(1, len(names) + 1):
        for axes in itertools.combinations(range(len(names)), n):
            index = tuple(slice(None) if d in axes else where[d] for d in range(len(names)))
            ranks = frozenset(int(r) for r in grid[index].reshape(-1))
            spans.setdefault(ranks, "+".join(names[d] for d in axes if grid.shape[d] > 1))
    return lambda ranks: spans.get(frozenset(ranks)) or "?"
