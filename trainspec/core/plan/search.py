"""Layouts of a device count: every (pipeline, data, fsdp, tensor, context, expert) factorisation
over the roles the spec's mesh has, hosts on the outer axes, ranked by predicted step time (those
that fit first)."""
from __future__ import annotations

import math
from collections.abc import Callable

from trainspec.core.errors import UserInputError
from trainspec.core.mesh import ParallelDims, resolve_mesh
from trainspec.core.plan.hardware import Profile
from trainspec.core.plan.model import Prediction
from trainspec.core.spec import Spec

ROLE_ORDER = ("pipeline", "data", "fsdp", "tensor", "context", "expert")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def role_axes(spec: Spec) -> dict[str, str]:
    """The one mesh axis of each role the search sizes; other axes stay at their spec size."""
    out = {}
    for role in ROLE_ORDER:
        axes = spec.mesh.axes_with_role(role)
        if axes:
            out[role] = axes[0]
    return out


def with_pipeline_axis(spec: Spec) -> Spec:
    """The spec with a `pipeline` axis of size 1 first (outermost), unless it has one: the axis
    the search sizes, whose traffic (stage boundaries' activations) may cross hosts."""
    if spec.mesh.axes_with_role("pipeline"):
        return spec
    data = spec.to_dict()
    data["mesh"]["axes"] = {"pipeline": {"role": "pipeline", "size": 1, "dcn": 1},
                            **data["mesh"]["axes"]}
    return Spec.model_validate(data)


def layout_for(spec: Spec, sizes: dict[str, int], n_devices: int, ici_domain: int) -> ParallelDims:
    """Axis sizes with the cross-domain factor placed on the outermost axes that can take it
    (in spec order: pipeline, data, then fsdp, whose traffic is point to point or once per
    step), or the spec's own dcn factors."""
    dcn = {a: spec.mesh.axes[a].dcn for a in sizes}
    hosts = max(1, n_devices // ici_domain)
    if math.prod(dcn.values()) == 1 and hosts > 1:
        for axis in sizes:  # spec order: major (outer) axes first
            take = math.gcd(hosts, sizes[axis])
            if spec.mesh.role_of(axis) != "tensor":
                dcn[axis], hosts = take, hosts // take
        if hosts > 1:
            raise UserInputError(
                f"--devices {n_devices}: {max(1, n_devices // ici_domain)} hosts do not divide the "
                f"pipeline, data and fsdp axes ({sizes}); tensor parallelism stays within a host")
    return ParallelDims.of(spec, sizes, dcn)


def spec_layout(spec: Spec, n_devices: int, ici_domain: int) -> ParallelDims:
    """The spec's own mesh (its -1 axis resolved) for n devices."""
    fixed = math.prod(a.size for a in spec.mesh.axes.values() if a.size != -1)
    if fixed > n_devices or n_devices % fixed:  # said in the flag's terms, before resolve_mesh
        raise UserInputError(f"mesh.axes: the fixed axis sizes multiply to {fixed}, which does not "
                             f"divide --devices {n_devices}")
    return layout_for(spec, resolve_mesh(spec, n_devices).shape, n_devices, ici_domain)


def _factorisations(n: int, roles: list[str]) -> list[dict[str, int]]:
    """Every way to write n as a product of sizes of `roles` (the last takes the rest)."""
    if len(roles) == 1:
        return [{roles[0]: n}]
    return [{roles[0]: d, **rest} for d in _divisors(n)
            for rest in _factorisations(n // d, roles[1:])]


def all_layouts(spec: Spec, n_devices: int, ici_domain: int) -> list[ParallelDims]:
    """Every factorisation of n over the role axes (others at size 1); tensor within a domain."""
    roles = role_axes(spec)
    out = []
    for sizes_by_role in _factorisations(n_devices, list(roles)):
        if sizes_by_role.get("tensor", 1) > ici_domain:
            continue
        sizes = {a: 1 for a in spec.mesh.axes}
        sizes.update({roles[role]: size for role, size in sizes_by_role.items()})
        try:
            out.append(layout_for(spec, sizes, n_devices, ici_domain))
        except UserInputError:
            continue
    return out


def ranked(predictions: list[Prediction]) -> list[Prediction]:
    """Layouts that fit first, fastest first; equal times: the least memory per device."""
    return sorted(predictions, key=lambda p: (not p.fits, p.step_time_s if p.fits else 0.0,
                                              p.memory_bytes if p.fits else 0.0))


def best_per_count(spec_for: Callable[[int], Spec], counts, profile: Profile,
                   predict: Callable[[Spec, ParallelDims], Prediction]) -> list[tuple[int, Prediction | None]]:
    """The fastest layout that fits at each device count (None where none fits)."""
    out = []
    for n in counts:
        spec = spec_for(n)
        preds = [predict(spec, lay) for lay in all_layouts(spec, n, profile.ici_domain)]
        fitting = [p for p in ranked(preds) if p.fits]
        out.append((n, fitting[0] if fitting else None))
    return out
