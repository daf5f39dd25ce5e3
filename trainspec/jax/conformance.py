"""The JAX backend under the conformance suite (`trainspec conformance --impl xla|ext|hierarchical`):
one adapter per collectives variant (trainspec/jax/collectives). The ops themselves are
trainspec.jax.collectives' (called inside `jax.shard_map`); this adapter gives them the suite's
shape (trainspec.core.adapter): devices, a collective run on NumPy blocks, DLPack,
fingerprints and the reference job.
"""
from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from trainspec.jax import collectives
from trainspec.core.adapter import OPS, Adapter
from trainspec.jax.capabilities import JAX
from trainspec.jax.backends import backend
from trainspec.jax.pipeline_params import staged_like, whole_arrays
from trainspec.jax.runtime import JaxRuntime
from trainspec.core.errors import UserInputError


@functools.cache
def _grid(shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()[: math.prod(shape)]).reshape(shape), axes)


def _x64(dtype: str):
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


@functools.cache
def _error_feedback(name: str, compression: str, block: int):
    """(x, residual) -> (dequantized x + residual, new residual) by the backend's kernels: the
    xla_ext handlers on ext, the jnp kernels on xla."""
    return jax.jit(functools.partial(backend(name).kernels().feedback_round_trip,
                                     compression=compression, block=block))


class JaxConformance(JaxRuntime, Adapter):
    capabilities = JAX

    def __init__(self, name: str = "xla"):
        super().__init__()
        declared = backend(name)
        self.name = self.backend = name
        self.guarantee_levels = dict.fromkeys(OPS, declared.guarantee)
        # the capability table refuses a compression where the backend has no kernels
        self.compressions = ("bf16", "int8") if declared.compression_kernels else ()

    def build_mesh(self, spec) -> Mesh:
        from trainspec.jax.mesh import build_mesh

        return build_mesh(spec)

    def run_collective(self, mesh_shape, mesh_axes, collective, blocks, dtype, axes, **kwargs):
        mesh_shape, mesh_axes = tuple(mesh_shape), tuple(mesh_axes)
        k = len(mesh_shape)
        axis_name = axes if isinstance(axes, str) else (axes[0] if len(axes) == 1 else tuple(axes))
        fn = getattr(collectives, collective)

        def body(block):
            out = fn(block.reshape(block.shape[k:]), axis_name, backend=self.backend, **kwargs)
            return out.reshape((1,) * k + out.shape)

        spec = P(*mesh_axes)
        run = jax.jit(jax.shard_map(body, mesh=_grid(mesh_shape, mesh_axes), in_specs=spec,
                                    out_specs=spec, check_vma=False))
        with _x64(dtype):
            out = np.asarray(run(np.asarray(blocks).astype(jnp.dtype(dtype))))
        wide = out.astype(np.int64 if dtype == "int32" else np.float64)
        return {idx: wide[idx] for idx in np.ndindex(*mesh_shape)}

    def round_trip(self, x: np.ndarray, dtype: str) -> np.ndarray:
        return np.asarray(x).astype(jnp.dtype(dtype)).astype(
            np.int64 if dtype == "int32" else np.float64)

    def to_dlpack(self, x):
        return x  # a jax.Array exports __dlpack__ itself

    def from_dlpack(self, obj):
        return jax.dlpack.from_dlpack(obj)

    def fingerprint(self, x) -> tuple[int, int]:
        from trainspec.jax.fingerprint import fingerprint

        low, high = np.asarray(fingerprint(x))
        return int(low), int(high)

    def error_feedback(self, x, residual, compression, block):
        sent, new_residual = _error_feedback(self.backend, compression, block)(x, residual)
        return np.asarray(sent), np.asarray(new_residual)

    def gather_objects(self, obj) -> list:
        if jax.process_count() > 1:
            raise UserInputError("--impl: the conformance runner drives the JAX backends from "
                                 "one process (its devices are the mesh)")
        return [obj]

    def train_steps(self, spec, params, batches):
        from trainspec.jax.train import build_job

        job = build_job(spec)
        held = staged_like(params, job.state.params)  # the blocks by stage under a pipeline
        state = job.state.replace(params=jax.device_put(held, job.step.state_shardings.params))
        steps = []
        for batch in batches:
            state, metrics = job.step(state, batch)
            metrics = job.step.host_metrics(metrics)
            steps.append((float(metrics["loss"]), float(metrics["grad_norm"]),
                          jax.device_get(whole_arrays(state.params))))
        return steps

    def train_run(self, spec, run_dir, steps):
        from trainspec.jax.train import run

        return run(spec, run_dir, steps=steps, progress=False)
