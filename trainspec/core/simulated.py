"""Devices simulated in one process, for an implementation without a device runtime of its own
(a NumPy one; tests/conformance/numpy_impl.py) and for counting the conformance suite's cases.

`SimulatedDevices` provides the adapter interface's devices, collectives and arrays: a
collective computes every member's result with the core's float64 reference
(trainspec/core/collectives_reference.py), after the same argument checks as every other
implementation, and rounds it to the dtype, as one fixed order of operations would
(`deterministic`). A subclass adds `name`, `capabilities`, `build_mesh` and the reference job.
"""
from __future__ import annotations

import numpy as np

from trainspec.core import collectives_reference as ref
from trainspec.core.adapter import OPS, Adapter
from trainspec.core.collective_calls import check_call
from trainspec.core.compression import round_to_bf16
from trainspec.core.fingerprint import fingerprint_reference


def held_as(x, dtype: str) -> np.ndarray:
    """`x` as a member holding `dtype` holds it, widened to float64 (int64 for int32)."""
    if dtype == "int32":
        return np.asarray(x).astype(np.int32).astype(np.int64)
    if dtype == "bfloat16":
        return round_to_bf16(np.asarray(x, np.float32)).astype(np.float64)
    return np.asarray(x).astype(dtype).astype(np.float64)


class SimulatedDevices(Adapter):
    """`devices` devices in this one process (abstract: the reference job is the subclass')."""

    guarantee_levels = dict.fromkeys(OPS, "deterministic")
    devices = 8

    def process_grid(self):
        return 0, 1

    def device_ids(self):
        return list(range(self.devices))

    def run_collective(self, mesh_shape, mesh_axes, collective, blocks, dtype, axes, **kwargs):
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        dims = tuple(mesh_axes.index(a) for a in axes)
        n = int(np.prod([mesh_shape[d] for d in dims]))
        local = np.asarray(blocks).shape[len(mesh_shape):]
        kwargs = check_call(collective, local, dtype, dtype != "int32", n,
                            axes[0] if len(axes) == 1 else axes, kwargs)
        groups, back = ref.to_groups(held_as(blocks, dtype), len(mesh_shape), dims)
        out = back(held_as(ref.REFERENCES[collective](groups, **kwargs), dtype))
        return {idx: out[idx] for idx in np.ndindex(*mesh_shape)}

    def round_trip(self, x, dtype):
        return held_as(x, dtype)

    def gather_objects(self, obj):
        return [obj]

    def to_dlpack(self, x):
        return np.asarray(x)

    def from_dlpack(self, obj):
        return np.from_dlpack(obj)

    def fingerprint(self, x):
        low, high = fingerprint_reference(np.ascontiguousarray(x).view(np.uint8).reshape(-1))
        return int(low), int(high)
