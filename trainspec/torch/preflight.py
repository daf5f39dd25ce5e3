"""`health.preflight = true` on torch: before training, every rank checks its device and the
process groups of the spec's mesh; a rank that fails is named in one line and left out of the
job (trainspec.torch.members, as `--exclude-devices`), and the rest train on.

- compute: a matmul of the doctor's inputs in each float dtype on the rank's device, against
  the float64 product within the core's rounding bound (trainspec.core.numerics);
- communication: an all-reduce of known integers over the whole job and over each split mesh
  axis: rank r sends (r + 1) * [1, 2, ..., n] in float32, so every sum is exact and must equal
  its value. Where a group's sum is wrong, an all-gather of what each member sent names the
  members whose values arrived wrong (all of them when each arrived right: the reduction
  itself failed).

The verdicts are gathered, so every rank leaves out the same ranks; the time counts as
initialisation badput.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from trainspec.core import numerics
from trainspec.core.spec import Spec
from trainspec.torch.runtime import TORCH_DTYPES, TorchRuntime
from trainspec.torch.members import leave_out

MATMUL = ((127, 255), (255, 129))  # the doctor's shapes: neither a power of two
LENGTH = 1000  # elements per all-reduce: sums up to world * (world + 1) / 2 * 1000, exact


def preflight(adapter: TorchRuntime, spec: Spec, goodput,
              fault: tuple[int, int] | None = None) -> tuple[Spec, dict]:
    """(the spec of the job without the failing ranks, the report); LeftOut on a failing
    rank. `fault` (launched rank, block): that rank sends only the whole blocks of each
    all-reduce's values, zeros for the rest (the test hook Faults.faulty_reduction). A no-op
    unless `health.preflight`."""
    if not spec.health.preflight:
        return spec, {}
    t0 = time.perf_counter()
    launched = adapter.launched_ids
    me = launched[adapter.process_index]
    block = fault[1] if fault and fault[0] == me else None
    mine = matmul_failures(adapter.device) + reduction_failures(adapter, spec, block)
    every = adapter.gather_objects(mine)
    failures = {launched[rank]: checks for rank, checks in enumerate(every) if checks}
    if adapter.is_writer():
        for rank, checks in sorted(failures.items()):
            print(f"trainspec: preflight: rank {rank} failed {len(checks)} check(s) (first: "
                  f"{checks[0]}); excluded", file=sys.stderr)
    report = {"excluded": sorted(failures), "checked": len(every),
              "failures": {str(r): c for r, c in failures.items()}}
    if failures:
        spec = leave_out(adapter, spec, failures, "it failed the preflight checks")
    report["seconds"] = time.perf_counter() - t0
    goodput.add("initialization", report["seconds"])
    return spec, report


def matmul_failures(device: torch.device) -> list[str]:
    """The matmuls on this rank's device whose error exceeds the rounding bound."""
    failed = []
    for dtype in numerics.DTYPES:
        a = numerics.selftest_inputs(MATMUL[0], dtype, 11, _torch_rounding)
        b = numerics.selftest_inputs(MATMUL[1], dtype, 12, _torch_rounding)
        on_device = [torch.from_numpy(x).to(device, TORCH_DTYPES[dtype]) for x in (a, b)]
        got = (on_device[0] @ on_device[1]).to(torch.float64).cpu().numpy()
        error = np.abs(got - a @ b)
        bound = numerics.matmul_error_bound(a, b, "float32", dtype)
        if not np.all(error <= bound):  # NaN fails
            worst = np.unravel_index(int(np.argmax(error / bound)), error.shape)
            failed.append(f"matmul {dtype} {MATMUL[0]}x{MATMUL[1]}: error {error[worst]:.3g} "
                          f"above the bound {bound[worst]:.3g}")
    return failed


def _torch_rounding(x: np.ndarray, dtype: str) -> np.ndarray:
    return torch.from_numpy(x).to(TORCH_DTYPES[dtype]).double().numpy()


def reduction_failures(adapter: TorchRuntime, spec: Spec, block: int | None) -> list[str]:
    """The all-reduces of known values (over the job, then each split axis of the spec's mesh)
    that came out wrong and blame this rank, each naming the members it blames."""
    mesh = adapter.build_mesh(spec)
    groups = {"the job": None, **{f"axis {name}": mesh.get_group(name)
                                 for name in mesh.mesh_dim_names if mesh.size(
                                     mesh.mesh_dim_names.index(name)) > 1}}
    me, failed = adapter.launched_ids[adapter.process_index], []
    for name, group in groups.items():
        members = dist.get_process_group_ranks(group) if group else list(range(
            adapter.process_count))
        sent = _values(adapter.process_index, block)
        summed = sent.clone()
        dist.all_reduce(summed, group=group)
        want = sum(_values(r, None) for r in members)
        if torch.equal(summed, want):
            continue
        arrived = [torch.empty_like(sent) for _ in members]
        dist.all_gather(arrived, sent, group=group)
        wrong = [r for r, got in zip(members, arrived) if not torch.equal(got, _values(r, None))]
        blamed = [adapter.launched_ids[r] for r in wrong or members]
        if me in blamed:
            failed.append(f"all-reduce over {name}: {int((summed != want).sum())} of {LENGTH} "
                          f"sums wrong, from ranks {blamed}")
    return failed


def _values(rank: int, block: int | None) -> torch.Tensor:
    """What `rank` sends: (rank + 1) * [1..n]; a faulty one (`block`) zeros its last partial
    block."""
    x = (rank + 1) * torch.arange(1, LENGTH + 1, dtype=torch.float32)
    if block:
        x[LENGTH - LENGTH % block:] = 0
    return x

