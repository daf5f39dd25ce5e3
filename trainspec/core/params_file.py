"""The framework-neutral parameter file: a run's initial parameters, which `trainspec train
--init-from RUN_OR_FILE` starts another run from, on either framework. Framework-free.

A safetensors file whose tensors are named by the reference model's parameter paths (the flax
tree's, 'block_0/query/kernel': trainspec.core.reference_train.param_shapes) in the flax
shapes, float32 whatever `precision.param` is (an implementation casts them on load), with the
model section it was written for in its metadata. Every reference-model run writes one,
RUN_DIR/initial_params.safetensors, when it starts from step 0; a run that resumes from a
checkpoint keeps the file of its start.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from trainspec.core.errors import UserInputError
from trainspec.core.reference_train import leaves, param_shapes
from trainspec.core.spec import ModelSpec

FILE_NAME = "initial_params.safetensors"
FLAG = "--init-from"
_MODEL_KEY = "trainspec.model"  # the metadata entry holding the model section, as JSON


def initial_params_path(run_dir: Path) -> Path:
    return Path(run_dir) / FILE_NAME


def write(path: Path, params: dict[str, np.ndarray], model: ModelSpec) -> None:
    """Write `params` (by parameter path) as float32, atomically: a reader (a run started with
    --init-from on it) never sees half a file."""
    tensors = {name: np.ascontiguousarray(value, np.float32) for name, value in params.items()}
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    save_file(tensors, str(tmp), metadata={_MODEL_KEY: json.dumps(model.model_dump())})
    os.replace(tmp, path)


def read(source: Path, model: ModelSpec) -> dict[str, np.ndarray]:
    """The float32 parameters, by path, of `source` (a run directory or a parameter file),
    checked against the spec's `model`: UserInputError, one line naming --init-from and what
    does not fit."""
    path = _file_of(Path(source))
    try:
        with safe_open(str(path), "numpy") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, ValueError, OSError) as err:
        raise UserInputError(f"{FLAG} {path}: not a safetensors parameter file ({err})") from None
    if _MODEL_KEY in metadata:  # a file another tool wrote has names and shapes only
        _check_model(path, json.loads(metadata[_MODEL_KEY]), model)
    expected = {name: tuple(int(d) for d in shape)  # leaves() gives each shape as an array
                for name, shape in leaves(param_shapes(model)).items()}
    _check_names_and_shapes(path, tensors, expected)
    return {name: tensors[name].astype(np.float32) for name in expected}


def resume_note(source: Path, checkpoint_dir: Path) -> str | None:
    """The line saying that `source` is not used, when the run directory has checkpoints: a
    resume wins over --init-from, so that a job restarted with the same command line (after a
    preemption, say) goes on instead of starting over; --restart starts from `source`."""
    directory = Path(checkpoint_dir)
    if directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir()):
        return (f"{FLAG} {source} not used: {directory} has checkpoints and the run resumes "
                "from the newest good one (--restart sets them aside and starts from it)")
    return None


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    """{'block_0/query/kernel': x} -> {'block_0': {'query': {'kernel': x}}} (the flax tree)."""
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _file_of(source: Path) -> Path:
    if source.is_dir():
        path = initial_params_path(source)
        if not path.is_file():
            raise UserInputError(f"{FLAG} {source}: the run directory has no {FILE_NAME} (a "
                                 "reference-model run writes it when it starts from step 0)")
        return path
    if not source.exists():
        raise UserInputError(f"{FLAG} {source}: no such file or run directory")
    return source


def _check_model(path: Path, written_for: dict, model: ModelSpec) -> None:
    wanted = model.model_dump()
    for key, value in wanted.items():
        if written_for.get(key) != value:
            raise UserInputError(
                f"{FLAG} {path}: written for model.{key} = {written_for.get(key)}, the spec "
                f"has model.{key} = {value}")


def _check_names_and_shapes(path: Path, tensors: dict, expected: dict[str, tuple]) -> None:
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise UserInputError(f"{FLAG} {path}: parameter {missing[0]} is missing"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise UserInputError(f"{FLAG} {path}: parameter {extra[0]} is not a parameter of the "
                             "spec's model" + (f" (and {len(extra) - 1} more)"
                                               if len(extra) > 1 else ""))
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise UserInputError(f"{FLAG} {path}: parameter {name} has shape {got}, the spec's "
                                 f"model needs {shape}")
        if not np.issubdtype(tensors[name].dtype, np.floating):
            raise UserInputError(f"{FLAG} {path}: parameter {name} is {tensors[name].dtype}, "
                                 "not floating point")
        if not np.all(np.isfinite(tensors[name])):
            raise UserInputError(f"{FLAG} {path}: parameter {name} holds non-finite values")
