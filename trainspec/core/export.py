"""Trained weights out of a run (`trainspec export RUN --to safetensors`), framework-free.

The reference model's parameters (by flax path, trainspec.core.reference_train.param_shapes)
in a Hugging Face style directory: `model.safetensors` with Llama's tensor names in torch's
(out, in) layout, and `config.json` with Llama's field names for the shape. The architecture is
trainspec's reference transformer (trainspec/jax/models/transformer.py,
trainspec/torch/models/transformer.py), not Llama's: `model_type` says so, and `from_hf` gives the
flax tree back for either implementation to load.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from trainspec.core.errors import UserInputError
from trainspec.core.reference_train import leaves, param_shapes
from trainspec.core.spec import ModelSpec

WEIGHTS, CONFIG = "model.safetensors", "config.json"
MODEL_TYPE = "trainspec-reference-transformer"

# flax path within a block -> (HF name within `model.layers.<i>.`, flax in-dims in the kernel)
BLOCK = {"attn_norm/scale": ("input_layernorm.weight", 0),
         "mlp_norm/scale": ("post_attention_layernorm.weight", 0),
         "query/kernel": ("self_attn.q_proj.weight", 1), "key/kernel": ("self_attn.k_proj.weight", 1),
         "value/kernel": ("self_attn.v_proj.weight", 1), "out/kernel": ("self_attn.o_proj.weight", 2),
         "mlp_in/kernel": ("mlp.up_proj.weight", 1), "mlp_out/kernel": ("mlp.down_proj.weight", 1)}
TOP = {"embedding": ("model.embed_tokens.weight", 0), "final_norm/scale": ("model.norm.weight", 0),
       "head/kernel": ("lm_head.weight", 1)}


def _names(model: ModelSpec) -> dict[str, tuple[str, int]]:
    """flax path -> (HF name, the kernel's input dimensions; 0: stored as it is)."""
    names = dict(TOP)
    for i in range(model.n_layers):
        names.update({f"block_{i}/{path}": (f"model.layers.{i}.{name}", n_in)
                      for path, (name, n_in) in BLOCK.items()})
    return names


def to_hf(params: dict[str, np.ndarray], model: ModelSpec) -> dict[str, np.ndarray]:
    """{HF name: float32 array}: a kernel (in dims..., out dims...) as torch's (out, in)."""
    out = {}
    for path, (name, n_in) in _names(model).items():
        value = np.asarray(params[path], np.float32)
        if n_in:
            inputs = math.prod(value.shape[:n_in])
            value = value.reshape(inputs, -1).T
        out[name] = np.ascontiguousarray(value)
    return out


def from_hf(tensors: dict[str, np.ndarray], model: ModelSpec) -> dict[str, np.ndarray]:
    """The inverse of `to_hf`: the parameters by flax path, in the flax shapes."""
    shapes = leaves(param_shapes(model))
    params = {}
    for path, (name, n_in) in _names(model).items():
        if name not in tensors:
            raise UserInputError(f"{WEIGHTS}: no tensor {name}")
        value = tensors[name]
        params[path] = (value.T if n_in else value).reshape(tuple(int(d) for d in shapes[path]))
    return params


def config(model: ModelSpec) -> dict:
    return {"model_type": MODEL_TYPE, "architectures": ["TrainspecReferenceTransformer"],
            "vocab_size": model.vocab_size, "hidden_size": model.d_model,
            "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
            "intermediate_size": model.d_ff, "torch_dtype": "float32",
            "trainspec_model": model.model_dump()}


def write(out: Path, params: dict[str, np.ndarray], model: ModelSpec, step: int) -> Path:
    """OUT/model.safetensors and OUT/config.json (each written whole, then renamed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS + ".tmp")
    save_file(to_hf(params, model), str(tmp), metadata={"format": "pt", "step": str(step)})
    os.replace(tmp, out / WEIGHTS)
    (out / (CONFIG + ".tmp")).write_text(json.dumps({**config(model), "step": step}, indent=2)
                                         + "\n")
    os.replace(out / (CONFIG + ".tmp"), out / CONFIG)
    return out


def read(directory: Path) -> tuple[dict[str, np.ndarray], ModelSpec]:
    """(parameters by flax path, the model section) of an exported directory."""
    directory = Path(directory)
    written = json.loads((directory / CONFIG).read_text())
    model = ModelSpec(**written["trainspec_model"])
    return from_hf(load_file(str(directory / WEIGHTS)), model), model
