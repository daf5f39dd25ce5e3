"""`health.preflight = true`: doctor's per-device checks before training; failing devices are
excluded through the same path as `--exclude-devices` (trainspec.jax.health.exclusion).

The time it takes is initialisation badput. In a job of several processes each checks its own
devices and the verdicts are gathered, so every process excludes the same devices.
"""
from __future__ import annotations

import logging
import time

import jax
import numpy as np

from trainspec.jax.health import doctor
from trainspec.core.exclusion import exclude
from trainspec.core.spec import Spec

log = logging.getLogger(__name__)


def _gathered(failing: dict[int, list[str]]) -> list[int]:
    """Ids of the failing devices of every process."""
    ids = [d.id for d in jax.devices()]
    flags = np.array([i in failing for i in ids])
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = np.asarray(multihost_utils.process_allgather(flags)).any(axis=0)
    return [i for i, bad in zip(ids, flags) if bad]


def preflight(spec: Spec, goodput, fault: doctor.Fault | None = None) -> tuple[Spec, dict]:
    """(spec with failing devices excluded, report). A no-op unless `health.preflight`."""
    if not spec.health.preflight:
        return spec, {}
    t0 = time.perf_counter()
    local = [d.id for d in jax.local_devices() if d.id not in spec.mesh.exclude_devices]
    failing = doctor.failing_devices(doctor.quick_device_checks(local, fault))
    excluded = _gathered(failing)
    for device, checks in sorted(failing.items()):
        log.warning("preflight: device %d failed %d numerics check(s) (first: %s); excluded",
                    device, len(checks), checks[0])
    seconds = time.perf_counter() - t0
    goodput.add("initialization", seconds)
    report = {"seconds": seconds, "excluded": excluded, "checked": len(local),
              "failures": {str(d): c for d, c in failing.items()}}
    return (exclude(spec, excluded) if excluded else spec), report
