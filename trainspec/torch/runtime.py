"""PyTorch implements the spec: torch.distributed (gloo on CPU, NCCL on GPU), one device per rank.

A job is joined from the same environment `trainspec launch` sets for JAX
(TRAINSPEC_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID), or from torchrun's (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). The spec's mesh axes become a DeviceMesh with the same names and
sizes, in the same (row-major) order, so rank r sits where device r sits in the JAX mesh.
"""
from __future__ import annotations

import datetime
import gc
import math
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainspec.torch import collectives, rendezvous
from trainspec.core.backend import OPS, Collectives, Runtime
from trainspec.torch.collectives import Group
from trainspec.torch.capabilities import TORCH
from trainspec.torch.mesh import device_mesh
from trainspec.torch.support import rank_from_env
from trainspec.core.job_env import described_job, env_int
from trainspec.core.collectives_reference import to_groups
from trainspec.core.fingerprint import fingerprint_reference
from trainspec.core.launch import COORDINATOR
from trainspec.core.spec import Spec


class TorchRuntime(Runtime, Collectives):
    """Devices, processes, the spec's mesh and the collectives on torch.distributed (the
    reference job for the conformance suite: trainspec.torch.conformance)."""

    name = "torch"
    # gloo and NCCL choose their reduction algorithms (ring, tree, ...) themselves and document
    # no fixed order, so no bitwise promise can be made (docs/adapters.md).
    guarantee_levels = dict.fromkeys(OPS, "nondeterministic")
    capabilities = TORCH
    compressions = ("bf16", "int8")  # trainspec/torch/compression.py

    def __init__(self, timeout_s: float = 120.0):
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.backend = "nccl" if self.device_type == "cuda" else "gloo"
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._joined_here = False
        self._groups: dict[tuple, dict[int, Group]] = {}
        self.launched_ids: list[int] = []  # rank -> its rank in the job as launched

    # -- processes and devices -------------------------------------------------------------
    def join(self) -> None:
        """Join the job the environment describes (a one-rank job when it describes none)."""
        if dist.is_initialized():
            self.launched_ids = self.launched_ids or list(range(dist.get_world_size()))
            return
        job = described_job()  # the trunk's reading, JOB_COMPLETION_INDEX included
        if job is not None:
            world, rank, coordinator = job.processes, job.process_id, job.coordinator
        elif os.environ.get("WORLD_SIZE"):  # torchrun: its agent's store
            world, rank, coordinator = env_int("WORLD_SIZE"), env_int("RANK"), None
        else:
            world, rank, coordinator = 1, 0, f"127.0.0.1:{_free_port()}"
        if self.device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        else:  # ranks on one host share its cores (trainspec launch starts them all locally)
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        if coordinator is None:
            dist.init_process_group(self.backend, init_method="env://", world_size=world,
                                    rank=rank, timeout=self.timeout)
        else:
            rendezvous.join(self.backend, coordinator, world, rank, self.timeout)
        self._joined_here = True
        self.launched_ids = list(range(world))

    def hosts(self) -> list[int]:
        """The host of each rank of the job: ranks are numbered host by host, torchrun's
        LOCAL_WORLD_SIZE on each; all on this one without it (trainspec launch starts them
        all locally)."""
        per_host = os.environ.get("LOCAL_WORLD_SIZE")
        launched = self.launched_ids or list(range(dist.get_world_size()))  # joined elsewhere
        return [rank // int(per_host) if per_host else 0 for rank in launched]

    def rejoin(self, kept: list[int]) -> bool:
        """Re-form the job over the ranks `kept` (every rank calls it): they join a new job,
        numbered in that order, over a rendezvous the first of them opens; whether this rank
        is one of them (the others are out of every group)."""
        me = dist.get_rank()
        address = [f"{_own_host()}:{_free_port()}" if me == kept[0] else None]
        dist.broadcast_object_list(address, src=kept[0])
        launched = self.launched_ids
        dist.destroy_process_group()
        self._groups.clear()
        if me not in kept:
            self._joined_here = False
            return False
        rendezvous.join(self.backend, address[0], len(kept), kept.index(me), self.timeout)
        self._joined_here = True
        self.launched_ids = [launched[r] for r in kept]
        return True

    def leave(self) -> None:
        """Leave the job this adapter joined: every process group destroyed, and freed now.

        destroy_process_group() only forgets the groups: a gloo group's worker and transport
        threads stop when its last Python reference (a DeviceMesh, a step's group, ours) is
        freed, and the run's objects hold them in reference cycles. Freed at interpreter exit
        instead, in whatever order finalization takes, a rank under load sometimes aborted
        after its job had finished ("terminate called without an active exception", SIGABRT).
        So the references go here and the cycles are collected, which joins those threads
        while the interpreter is whole; the caller drops its own (trainspec.torch.train)."""
        if self._joined_here and dist.is_initialized():
            dist.destroy_process_group()
            self._joined_here = False
        self._groups.clear()
        gc.collect()

    def process_grid(self) -> tuple[int, int]:
        return dist.get_rank(), dist.get_world_size()

    def speaks_for_job(self) -> bool:
        """The first of the ranks the job has now (it may have been re-formed without the
        launched rank 0), answered from the launcher's environment, after the job is left too."""
        return (self.launched_ids or [0])[0] == rank_from_env()

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def device_ids(self) -> list[int]:
        return list(range(self.process_count))  # one device per rank, numbered by rank

    # -- the mesh --------------------------------------------------------------------------
    def build_mesh(self, spec: Spec) -> DeviceMesh:
        """The spec's axes as a DeviceMesh of the job's ranks (one device per rank), same
        names and sizes as the JAX mesh: row-major on one host, host-major with dcn factors
        across hosts (trainspec.torch.mesh)."""
        return device_mesh(spec, self.device_type, self.hosts())

    # -- collectives ------------------------------------------------------------------------
    def groups(self, mesh_shape: tuple[int, ...], axes_dims: tuple[int, ...]) -> dict[int, Group]:
        """global rank -> its Group, for collectives over `axes_dims` of a row-major grid of
        the first prod(mesh_shape) ranks. Every rank creates every group, in the same order
        (torch.distributed requires it), members or not."""
        key = (mesh_shape, axes_dims)
        if key not in self._groups:
            grid = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
            members, _ = to_groups(grid, len(mesh_shape), axes_dims)
            found = {}
            for ranks in members.tolist():
                handle = dist.new_group(ranks, timeout=self.timeout)
                found.update({r: Group(tuple(ranks), handle) for r in ranks})
            self._groups[key] = found
        return self._groups[key]

    def run_collective(self, mesh_shape, mesh_axes, collective, blocks, dtype, axes, **kwargs):
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        groups = self.groups(tuple(mesh_shape), tuple(mesh_axes.index(a) for a in axes))
        rank = self.process_index
        if rank not in groups:
            return {}
        coords = tuple(int(c) for c in np.unravel_index(rank, mesh_shape))
        x = torch.from_numpy(np.array(blocks[coords])).to(TORCH_DTYPES[dtype])
        result = collectives.call(groups[rank], collective, x, **kwargs)
        wide = torch.int64 if dtype == "int32" else torch.float64
        return {coords: result.to(wide).numpy()}

    def round_trip(self, x: np.ndarray, dtype: str) -> np.ndarray:
        wide = torch.int64 if dtype == "int32" else torch.float64
        return torch.from_numpy(np.asarray(x)).to(TORCH_DTYPES[dtype]).to(wide).numpy()

    def error_feedback(self, x, residual, compression, block):
        from trainspec.torch.compression import decode, encode

        corrected = torch.from_numpy(np.asarray(x, np.float32) + np.asarray(residual, np.float32))
        sent = decode(encode(corrected[None], compression, block), compression, block,
                      corrected.numel())[0]
        return sent.numpy(), (corrected - sent).numpy()

    def gather_objects(self, obj) -> list:
        every: list = [None] * self.process_count
        dist.all_gather_object(every, obj)
        return every

    # -- arrays -------------------------------------------------------------------------------
    def to_dlpack(self, x):
        return x.detach()  # a torch tensor exports __dlpack__ itself

    def from_dlpack(self, obj):
        return torch.from_dlpack(obj)

    def fingerprint(self, x) -> tuple[int, int]:
        return fingerprint(x)


def fingerprint(x: torch.Tensor) -> tuple[int, int]:
    """The spec's fingerprint of a tensor's bytes (trainspec.core.fingerprint)."""
    raw = x.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    low, high = fingerprint_reference(raw)
    return int(low), int(high)


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64, "int32": torch.int32}


def _own_host() -> str:
    """This host as the others reach it: the launcher's loopback coordinator when all ranks
    run here, else its name."""
    coordinator = os.environ.get(COORDINATOR, os.environ.get("MASTER_ADDR", "127.0.0.1"))
    host = coordinator.rsplit(":", 1)[0]
    return host if host in ("127.0.0.1", "localhost") else socket.gethostname()


def _free_port() -> int:
    from trainspec.core.launch import free_port

    return free_port()
