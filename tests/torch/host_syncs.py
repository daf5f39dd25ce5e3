"""Counting host syncs: every way Python reads a tensor's value on the host (item, tolist,
numpy, bool/float/int/index conversions, and torch.distributed's object collectives, which
pickle on the host), patched on torch.Tensor and torch.distributed while a `HostSyncs` is open;
and every read torch makes itself for a Python call (`aten._local_scalar_dense`, caught by a
dispatch mode: indexing with a tensor reads it so, unseen by the patches).
On a GPU each of these waits for the device; on the CPU the same calls mark where a step would.
Waiting on a collective's work handle is not counted: on gloo the host runs the collective, and
on NCCL `wait()` orders streams without blocking the host."""
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

TENSOR_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object")


class HostSyncs:
    """`with HostSyncs() as syncs:` ... `syncs.count`, `syncs.where` (the calls' names)."""

    def __init__(self):
        self.where: list[str] = []
        self._saved: list = []

    @property
    def count(self) -> int:
        return len(self.where)

    def _counted(self, owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.where.append(name)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self):
        for name in TENSOR_READS:
            self._counted(torch.Tensor, name)
        for name in OBJECT_COLLECTIVES:
            self._counted(dist, name)
        self._mode = _ScalarReads(self.where)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)


class _ScalarReads(TorchDispatchMode):
    """Notes each `aten._local_scalar_dense` (a tensor's value read to the host) in `where`."""

    def __init__(self, where: list[str]):
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.where.append("aten._local_scalar_dense")
        return func(*args, **(kwargs or {}))
