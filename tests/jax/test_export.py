"""`trainspec export RUN --to safetensors`: a JAX run's trained weights (its newest checkpoint)
in a Hugging Face style directory (model.safetensors in torch's (out, in) layout, Llama's tensor
names, config.json), read back bit for bit, and loaded by plain torch (the reference
nn.Module, load_state_dict) and by flax (Transformer.apply): both give the trained model's
logits on the same tokens."""
import json

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tiny import TINY
from trainspec.cli.main import main
from trainspec.core import export, params_file
from trainspec.core.spec import load_spec
from trainspec.jax.export import trained_params
from trainspec.jax.models.transformer import Transformer as FlaxTransformer
from trainspec.torch.models.transformer import Transformer as TorchTransformer, from_flax


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    run, out = tmp / "run", tmp / "hf"
    sets = [a for s in (*TINY, "checkpoint.interval=2", "checkpoint.async_save=false")
            for a in ("--set", s)]
    assert main(["train", "--quiet", "--steps", "2", "--run-dir", str(run), *sets]) == 0
    assert main(["export", str(run), "--to", "safetensors", "--out", str(out)]) == 0
    return run, out


def test_the_export_is_the_trained_checkpoint_in_torch_layout(exported):
    run, out = exported
    spec = load_spec(run / "spec.toml")
    trained, step = trained_params(spec, run)
    back, model = export.read(out)
    assert step == 2 and model == spec.model
    assert back.keys() == trained.keys()
    for path in trained:
        np.testing.assert_array_equal(back[path], trained[path])  # bit for bit
    initial = params_file.read(run, spec.model)  # training moved every kernel
    assert not np.array_equal(trained["block_0/query/kernel"], initial["block_0/query/kernel"])
    tensors = load_file(str(out / "model.safetensors"))
    d, h = spec.model.d_model, spec.model.n_heads
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (d, d)  # (out, in)
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_proj.weight"],
                                  trained["block_0/query/kernel"].reshape(d, d).T)
    assert tensors["lm_head.weight"].shape == (spec.model.vocab_size, d)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["step"]) == (d, h, 2)


def test_plain_torch_and_flax_give_the_same_logits(exported):
    _, out = exported
    params, model = export.read(out)
    tokens = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % model.vocab_size
    tree = params_file.unflatten(params)
    flax_logits = np.asarray(FlaxTransformer(model).apply({"params": tree}, tokens))
    module = TorchTransformer(model)
    module.load_state_dict(from_flax(module, tree))
    with torch.no_grad():
        torch_logits = module(torch.from_numpy(tokens).long()).numpy()
    assert flax_logits.shape == (2, 16, model.vocab_size)
    # float32 in two frameworks: summation orders differ, a few ulps of logits of size ~10
    np.testing.assert_allclose(torch_logits, flax_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("argv,line", [
    (["--to", "onnx"], "--to onnx: not a format; one of safetensors"),
    ([], "is not a run directory (no spec.toml)"),
])
def test_a_bad_export_is_one_line(tmp_path, capsys, argv, line):
    assert main(["export", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err, err
