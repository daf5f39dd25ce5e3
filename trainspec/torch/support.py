"""What the torch implementation decides without loading torch: whether this process is one
rank of a job (from the launcher's environment), and whether it can honour a spec, so that a
bad spec is refused with one line before any rank starts (docs/adapters.md)."""
from __future__ import annotations

import os

from trainspec.core.errors import UserInputError
from trainspec.core.mesh import check_batch, resolve_mesh
from trainspec.core.spec import Spec
from trainspec.core.launch import COORDINATOR, PROCESS_ID


def env_int(name: str) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise UserInputError(f"environment variable {name}: expected an integer, got {raw!r}") from None


def launched() -> bool:
    """Whether this process is one rank of a job (trainspec launch, torchrun)."""
    return bool(os.environ.get(COORDINATOR) or os.environ.get("TORCHELASTIC_RUN_ID")
                or os.environ.get("WORLD_SIZE"))


def rank_from_env() -> int:
    """This process's rank as the launcher set it (0 when not launched)."""
    for name in (PROCESS_ID, "RANK"):
        if os.environ.get(name):
            return env_int(name)
    return 0


def check_spec(spec: Spec, world: int) -> None:
    """Fields the torch implementation cannot honour for the reference model on `world` ranks:
    one line naming the field and why, before anything starts (never a silent fallback)."""
    sizes = check_layout(spec, world)
    c = spec.model
    for axis in split_axes(spec, sizes, "tensor"):
        for field, value in (("n_heads", c.n_heads), ("d_ff", c.d_ff), ("vocab_size", c.vocab_size)):
            if value % sizes[axis]:
                raise UserInputError(f"model.{field}: {value} is not divisible by the "
                                     f"{sizes[axis]} ranks of tensor axis '{axis}'")


def split_axes(spec: Spec, sizes: dict[str, int], role: str) -> list[str]:
    """The axes of `role` that split something (size > 1)."""
    return [a for a in spec.mesh.axes_with_role(role) if sizes[a] > 1]


def check_layout(spec: Spec, world: int) -> dict[str, int]:
    """What the torch implementation cannot honour on `world` ranks whatever the model (the
    reference one or a user's, trainspec.torch.wrap); the mesh's axis sizes when it can."""
    if spec.layout.rules:
        raise UserInputError("layout.rules: the torch implementation lays out a model by module "
                             "names, not logical axes (trainspec.torch.wrap's fsdp_units and "
                             "tensor_plan; docs/adapters.md); remove the rules")
    if spec.layout.optimizer_state != "like_params":
        raise UserInputError("layout.optimizer_state: the torch implementation keeps optimizer "
                             "state like its parameter (FSDP2 shards both); use like_params")
    if spec.remat.policy != "none":
        raise UserInputError(f"remat.policy: {spec.remat.policy!r} has no torch counterpart "
                             "here (it names jax checkpoint policies); use none")
    if spec.collectives.backend != "xla":
        raise UserInputError(f"collectives.backend: {spec.collectives.backend!r} is a JAX "
                             "backend; the torch implementation reduces through torch.distributed "
                             "(leave the default)")
    if spec.collectives.compression != "none":
        raise UserInputError(f"collectives.compression: {spec.collectives.compression!r} is not "
                             "implemented by the torch implementation (its gradients are "
                             "reduced in float32; docs/adapters.md); use none")
    if spec.semi_sync is not None:
        raise UserInputError("semi_sync: the torch implementation trains synchronously only; "
                             "remove the [semi_sync] table")
    if spec.metrics.gns:
        raise UserInputError("metrics.gns: the torch implementation does not measure the "
                             "gradient noise scale (its records leave the gns fields null)")
    if spec.mesh.exclude_devices:
        raise UserInputError(
            "mesh.exclude_devices: the torch implementation runs one device per rank and "
            "cannot leave ranks out of a started job; start fewer ranks instead")
    resolved = resolve_mesh(spec, world)
    sizes = dict(zip(resolved.names, resolved.sizes))
    for role in ("fsdp", "tensor"):
        if len(split_axes(spec, sizes, role)) > 1:
            raise UserInputError(f"mesh.axes: the torch implementation splits at most one "
                                 f"{role} axis, got {', '.join(split_axes(spec, sizes, role))}")
    batch_axes = split_axes(spec, sizes, "data") + split_axes(spec, sizes, "fsdp")
    check_batch(spec, resolved, [a for a in resolved.names if a in batch_axes])
    return sizes
