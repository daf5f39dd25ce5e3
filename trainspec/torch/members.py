"""Ranks left out of a torch job: the ones `mesh.exclude_devices` (`--exclude-devices`) names
when it starts, and the diverged replicas a fingerprint vote names under
`health.fingerprints.policy = "rollback"` while it runs.

A running torch.distributed job cannot drop members from its groups, so it is re-formed: every
rank agrees on the ranks kept (trainspec.torch.support.ranks_kept: the longest prefix of the
healthy ranks the spec still fits, as the JAX mesh shrinks), the first of them opens a new
rendezvous, the old groups are destroyed, and the kept ranks join a new job numbered in their
order; the others raise LeftOut and their process exits 0. Ids in `mesh.exclude_devices` stay
the ranks of the job as launched (TorchRuntime.launched_ids), whatever the job's ranks are now.
"""
from __future__ import annotations

from collections.abc import Iterable

from trainspec.core.exclusion import exclude
from trainspec.core.spec import Spec
from trainspec.core.errors import LeftOut
from trainspec.torch.runtime import TorchRuntime
from trainspec.core.mesh import usable_ids
from trainspec.torch.support import excluding, ranks_kept


def leave_out(adapter: TorchRuntime, spec: Spec, ids: Iterable[int], why: str) -> Spec:
    """Re-form the job without the ranks `ids` (ranks of the job as launched; every rank calls
    it with the same ones); the spec of the smaller job, with them in `mesh.exclude_devices`.
    LeftOut on the ranks not kept, saying `why`."""
    launched = adapter.launched_ids
    ids = sorted(set(ids))
    smaller = exclude(spec, ids)
    usable_ids(excluding(spec, ids), launched)  # an id not in the job: refused by name
    kept = ranks_kept(spec, adapter.process_count, [launched.index(i) for i in ids])
    me = launched[adapter.process_index]
    if not adapter.rejoin(kept):
        role = "excluded" if me in smaller.mesh.exclude_devices else "idle: the mesh does not fit it"
        raise LeftOut(f"rank {me} left the job ({role}; {why})")
    return smaller


def exclude_at_start(adapter: TorchRuntime, spec: Spec) -> Spec:
    """The job without the ranks `mesh.exclude_devices` names (the job as launched)."""
    if not spec.mesh.exclude_devices:
        return spec
    return leave_out(adapter, spec, spec.mesh.exclude_devices, "mesh.exclude_devices")
