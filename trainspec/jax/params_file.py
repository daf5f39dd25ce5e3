"""The framework-neutral parameter file (trainspec.core.params_file) on JAX: the file's
parameters placed as the step's sharded arrays, and a state's parameters gathered to write one."""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import linen as nn
from jax.experimental import multihost_utils

from trainspec.core import params_file
from trainspec.core.spec import ModelSpec
from trainspec.jax.runtime import is_writer


def _path_name(path) -> str:
    return "/".join(str(k.key) for k in path)


def placed(abstract_params, flat: dict[str, np.ndarray]):
    """The file's parameters (by path) as global arrays shaped, typed and sharded like
    `abstract_params` (ShapeDtypeStructs): each process puts only its own shards on its
    devices, so a parameter is never whole on one."""
    def place(path, leaf):
        whole = flat[_path_name(path)]
        return jax.make_array_from_callback(
            leaf.shape, leaf.sharding, lambda index: whole[index].astype(leaf.dtype))
    return jax.tree_util.tree_map_with_path(place, abstract_params)


def with_values(boxed_params, values):
    """`boxed_params` (an init's, flax-boxed with their logical axes) holding `values`
    instead: the boxes stay, so the step plans the same layout as for a seeded init."""
    def is_box(x) -> bool:
        return isinstance(x, nn.meta.AxisMetadata)
    return jax.tree.map(lambda box, value: box.replace_boxed(value) if is_box(box) else value,
                        boxed_params, values, is_leaf=is_box)


def host_params(params) -> dict[str, np.ndarray]:
    """Every parameter whole on the host, by path. Across processes a gather: every process
    must call it."""
    def whole(x) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {_path_name(path): whole(x) for path, x in leaves}


def save_initial(params, run_dir: Path, model: ModelSpec) -> None:
    """RUN_DIR/initial_params.safetensors from a state's parameters (process 0 writes)."""
    host = host_params(params)
    if is_writer():
        params_file.write(params_file.initial_params_path(run_dir), host, model)
