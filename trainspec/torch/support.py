"""What the torch implementation decides without loading torch: whether this process is one
rank of a job (from the launcher's environment), and whether it can honour a spec, so that a
bad spec is refused with one line before any rank starts (docs/adapters.md)."""
from __future__ import annotations

import os

from trainspec.core.capabilities import Request
from trainspec.core.exclusion import first_that_fits, prefixes
from trainspec.core.mesh import ParallelDims, check_batch, resolve_mesh, usable_ids
from trainspec.core.spec import Spec
from trainspec.core.job_env import env_int, process_id_from_env  # noqa: F401 (re-exported)
from trainspec.core.launch import COORDINATOR
from trainspec.torch.capabilities import TORCH


def launched() -> bool:
    """Whether this process is one rank of a job (trainspec launch, torchrun)."""
    return bool(os.environ.get(COORDINATOR) or os.environ.get("TORCHELASTIC_RUN_ID")
                or os.environ.get("WORLD_SIZE"))


def rank_from_env() -> int:
    """This process's rank as the launcher set it (0 when not launched)."""
    return process_id_from_env("RANK")


# The sections a step depends on whatever the model (the reference one or a user's); the
# reference model's step adds `model.`; a run checks every field, and the train flags.
LAYOUT_SECTIONS = ("mesh.", "layout.", "precision.", "batch.", "remat.", "collectives.",
                   "optimizer.", "semi_sync", "metrics.gns", "pipeline.")


def _check(spec: Spec, world: int, fields=None, flags: dict | None = None) -> ParallelDims:
    """The torch capability table's refusals of `spec` on `world` ranks (of the `fields`
    chosen), then the batch's split; the mesh's dims when nothing is refused."""
    TORCH.check(Request(spec, resolve_mesh(spec, world), flags or {}), fields)
    return check_mesh(spec, world)


def check_mesh(spec: Spec, world: int) -> ParallelDims:
    """The spec's mesh on `world` ranks, once the batch's rows split over it."""
    dims = resolve_mesh(spec, world)
    check_batch(spec, dims, batch_axes(dims))
    return dims


def batch_axes(dims: ParallelDims) -> tuple[str, ...]:
    """The axes that split the batch's rows (data, fsdp and expert), in mesh order."""
    return tuple(a for a in dims.names
                 if a in dims.split("data") + dims.split("fsdp") + dims.split("expert"))


def token_axes(dims: ParallelDims) -> tuple[str, ...]:
    """The axes whose ranks hold different tokens (the batch axes and the context axes), in
    mesh order: the loss sums and valid tokens of a step are summed over them."""
    return tuple(a for a in dims.names if a in batch_axes(dims) + dims.split("context"))


def ranks_kept(spec: Spec, world: int, left_out) -> list[int]:
    """The ranks of a `world`-rank job that go on without `left_out` (ranks of the job as it
    is now): the longest prefix of the others the spec's mesh and batch fit
    (trainspec.core.exclusion); the rest idle."""
    def fits(ranks: list[int]) -> list[int]:
        check_mesh(spec, len(ranks))
        return ranks

    usable = usable_ids(excluding(spec, left_out), list(range(world)))
    return first_that_fits(prefixes(usable), fits)


def excluding(spec: Spec, ids) -> Spec:
    """`spec` with exactly `ids` in `mesh.exclude_devices` (the job's earlier exclusions are
    ids of the job as launched, already gone)."""
    return spec.model_copy(update={"mesh": spec.mesh.model_copy(
        update={"exclude_devices": sorted(set(ids))})})


def check_layout(spec: Spec, world: int) -> ParallelDims:
    """What the torch implementation cannot honour on `world` ranks whatever the model (the
    reference one or a user's, trainspec.torch.wrap); the mesh's dims when it can."""
    return _check(spec, world, lambda field: field.startswith(LAYOUT_SECTIONS))


def check_spec(spec: Spec, world: int) -> None:
    """... and for the reference model (its sizes against the tensor axis)."""
    _check(spec, world, lambda field: field.startswith((*LAYOUT_SECTIONS, "model.")))


def check_run(spec: Spec, world: int, flags: dict | None = None,
              own_model: bool = False) -> None:
    """Every field of the spec (and the `flags` of `trainspec train` given) for a run of the
    reference job on `world` ranks, or of a user's model (`own_model`: the `[model]` section
    describes the reference model only): one line naming the field and why, before anything
    starts (never a silent fallback)."""
    fields = (lambda field: not field.startswith("model.")) if own_model else None
    _check(spec, world, fields, flags)
