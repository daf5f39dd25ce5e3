"""The JAX side of fault injection (trainspec.core.faults): a bit flipped in one device's copy
of the state, and the doctor's faulty reduction."""
from __future__ import annotations

import jax

from trainspec.core.faults import ENV, Faults, InjectedCrash
from trainspec.jax.health.replicas import flip_bit

__all__ = ["ENV", "Faults", "InjectedCrash", "faulty_reduction", "flip_first_param"]


def faulty_reduction(faults: Faults):
    """The doctor's Fault that `faults.faulty_reduction` asks for, or None."""
    from trainspec.jax.health.doctor import Fault

    return Fault(*faults.faulty_reduction) if faults.faulty_reduction else None


def flip_first_param(state, device_id: int):
    """`state` with bit 20 of the first parameter flipped in `device_id`'s copy only (a device
    no longer in the mesh, excluded, is left alone)."""
    leaves, treedef = jax.tree.flatten(state.params)
    if device_id not in {d.id for d in leaves[0].sharding.device_set}:
        return state
    leaves[0] = flip_bit(leaves[0], device_id, bit=20)
    return state.replace(params=jax.tree.unflatten(treedef, leaves))
