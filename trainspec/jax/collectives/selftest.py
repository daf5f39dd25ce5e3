"""The collectives backends' all_reduce against float64 (part of `trainspec doctor`).

A collective's summation order is unspecified, so each result is held to the sequential bound
(trainspec.core.numerics), which holds for any order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainspec.jax.collectives import api
from trainspec.core import numerics

AXIS = "dev"


def collective_results(device_ids, backends) -> list[numerics.Result]:
    """Each backend's all_reduce(sum) of a per-device odd-length vector against float64."""
    by_id = {d.id: d for d in jax.devices()}
    mesh = Mesh(np.array([by_id[i] for i in device_ids]), (AXIS,))
    n_dev, length = len(device_ids), 4099
    results = []
    for backend in backends:
        for dtype in numerics.DTYPES:
            x = numerics.selftest_inputs((n_dev, length), dtype, 21)
            arr = jax.device_put(jnp.asarray(x, dtype), NamedSharding(mesh, P(AXIS)))
            fn = jax.jit(jax.shard_map(
                lambda a: api.all_reduce(a, AXIS, "sum", backend=backend),
                mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))
            got = np.asarray(fn(arr).astype(jnp.float32), np.float64).reshape(n_dev, length)
            exact = x.sum(axis=0)  # 8 terms: float64 is exact here
            bound = ((n_dev - 1) * numerics.EPS[dtype] / 2 * np.abs(x).sum(axis=0)
                     + numerics.EPS[dtype] / 2 * np.abs(exact))
            for dev, row in zip(device_ids, got):
                ratio = np.abs(row - exact) / bound
                worst = int(np.argmax(ratio))
                results.append(numerics.Result(f"all_reduce[{backend}] {dtype} n={length}", dev,
                                               float(abs(row[worst] - exact[worst])), float(bound[worst])))
    return results
