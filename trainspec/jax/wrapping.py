"""`trainspec.jax.wrap`: the spec applied to a user's step, the one public way in
(docs/wrapping.md). It picks the step class the spec calls for: a `WrappedStep`
(trainspec/jax/step.py), or under a `[semi_sync]` table a `SemiSyncStep`
(trainspec/jax/semi_sync.py)."""
from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from trainspec.core.spec import Spec
from trainspec.jax.semi_sync import SemiSyncStep
from trainspec.jax.step import WrappedStep


def wrap(step_fn, spec: Spec, mesh: Mesh | None = None,
         devices: int | Sequence[jax.Device] | None = None, *,
         nan_guard: bool = True) -> WrappedStep | SemiSyncStep:
    """Apply `spec` to `step_fn`, a plain step or a `loss_step(loss_fn)`. See WrappedStep.

    `devices`: run on these devices (or the first n) instead of all of them; `mesh`: on this
    mesh as it is. A SemiSyncStep when the spec has a `[semi_sync]` table."""
    cls = SemiSyncStep if spec.semi_sync is not None else WrappedStep
    return cls(step_fn, spec, mesh, devices, nan_guard=nan_guard)
