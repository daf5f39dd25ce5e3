"""The data-parallel gradient reduction of wrap()'s explicit paths: per-replica gradients,
stacked on a leading axis bound to the data axes, summed through the spec's collectives backend
in one fused buffer, compressed with error feedback when the spec asks (trainspec.jax.collectives.
compression; on the ext backend the xla_ext packed-buffer handlers)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from trainspec.jax import collectives
from trainspec.jax.backends import backend
from trainspec.core.spec import Spec


def reduce_over_replicas(spec: Spec, mesh: Mesh, data: tuple[str, ...], param_pspecs, replicas: int,
                     compressed: bool, stacked, residual=None):
    """Sum per-replica gradients (stacked on a leading axis bound to the data axes) through
    the spec's collectives backend; the result is laid out like the parameters.

    With `collectives.compression`, the reduction is compressed (trainspec.jax.collectives.
    compression) and returns (sum, new residual); the residual, stacked like the gradients,
    is None without error feedback."""
    group = data if len(data) > 1 else data[0]
    if compressed:  # the backend's kernels (ext's need the compiled extension)
        kernels = backend(spec.collectives.backend).kernels()
        compressed_sum = functools.partial(kernels.compressed_sum,
                                           timeout_s=spec.collectives.timeout_s)

    def body(g, r=None):
        # Fused (Horovod's tensor fusion): one all-reduce of every local gradient
        # shard packed into a single buffer, rather than one collective per leaf.
        leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: x[0], g))
        offsets = np.cumsum([0] + [x.size for x in leaves])
        unpack = lambda flat, lead=(): treedef.unflatten([  # noqa: E731
            flat[a:b].reshape(*lead, *x.shape) for a, b, x in zip(offsets, offsets[1:], leaves)
        ])
        packed = jnp.concatenate([x.ravel() for x in leaves])
        if not compressed:  # in place: the fused buffer dies with the call (ext needs no second)
            return unpack(collectives.all_reduce(
                packed, group, "sum", in_place=True,
                timeout_s=spec.collectives.timeout_s, backend=spec.collectives.backend))
        owed = None if r is None else jnp.concatenate([x.ravel() for x in jax.tree.leaves(r)])
        flat, new_residual = compressed_sum(
            packed, owed, group, replicas, spec.collectives.compression,
            spec.collectives.compression_block)
        return unpack(flat) if r is None else (unpack(flat), unpack(new_residual, (1,)))

    in_specs = jax.tree.map(lambda ps: P(data, *ps), param_pspecs,
                            is_leaf=lambda x: isinstance(x, P))
    if residual is None:
        return jax.shard_map(body, mesh=mesh, in_specs=(in_specs,),
                             out_specs=param_pspecs, check_vma=False)(stacked)
    return jax.shard_map(body, mesh=mesh, in_specs=(in_specs, in_specs),
                         out_specs=(param_pspecs, in_specs), check_vma=False)(stacked, residual)
