"""Counting host syncs: every way Python reads a tensor's value on the host (item, tolist,
numpy, bool/float/int/index conversions, and torch.distributed's object collectives, which
pickle on the host), patched on torch.Tensor and torch.distributed while a `HostSyncs` is open.
On a GPU each of these waits for the device; on the CPU the same calls mark where a step would.
Waiting on a collective's work handle is not counted: on gloo the host runs the collective, and
on NCCL `wait()` orders streams without blocking the host."""
import torch
import torch.distributed as dist

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
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
