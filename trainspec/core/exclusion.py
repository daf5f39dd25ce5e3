"""Leaving devices out, framework-free: the spec that names them, and the largest set of the
devices left that the spec still fits (trainspec.jax.health.exclusion lays JAX devices out on
it; trainspec.torch.members re-forms a torch job on it).

Bad devices come from the user (`mesh.exclude_devices`, `trainspec train --exclude-devices`) or
from a detector (replica fingerprints name the diverged copies). The spec's fixed axis sizes
and the batch's divisibility stay constraints; what may shrink is the device count: the `-1`
axis absorbs the change, and the devices beyond the largest count that fits stay idle.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec, load_spec

T, R = TypeVar("T"), TypeVar("R")


def exclude(spec: Spec, device_ids: Iterable[int]) -> Spec:
    """`spec` with `device_ids` added to `mesh.exclude_devices`."""
    data = spec.to_dict()
    data["mesh"]["exclude_devices"] = sorted(set(spec.mesh.exclude_devices) | set(device_ids))
    return load_spec(data)


def first_that_fits(candidates: Iterable[T], build: Callable[[T], R]) -> R:
    """`build` of the first candidate (largest first) it accepts (it raises UserInputError
    when the spec does not fit one); when none fits, the error for the first (the largest)."""
    errors = []
    for candidate in candidates:
        try:
            return build(candidate)
        except UserInputError as err:
            errors.append(err)
    raise errors[0]


def prefixes(usable: Sequence[T]) -> list[list[T]]:
    """The prefixes of `usable`, longest first: the candidates where each device is a process
    of its own (torch's ranks) or all are in one process."""
    if not usable:
        raise UserInputError("mesh.exclude_devices: every device is excluded")
    return [list(usable[:n]) for n in range(len(usable), 0, -1)]
