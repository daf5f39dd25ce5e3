"""`trainspec export RUN --to safetensors` of a torch run (2 ranks, fsdp = 2, so each rank's
file holds half of every sharded parameter): the backend that wrote the checkpoints is found
through the registry and reads them whole in one process; plain torch on the exported weights
gives the run's own recorded eval loss, and flax the same logits."""
import json

import jax
import numpy as np
import pytest
import torch

from cli_runs import read_records, run_cli, train_command
from tiny import TINY
from trainspec.cli.main import main
from trainspec.core import export, params_file
from trainspec.core.evaluation import reference_batches
from trainspec.core.spec import load_spec
from trainspec.jax.models.transformer import Transformer as FlaxTransformer
from trainspec.torch.models.transformer import Transformer, from_flax, next_token_loss

SETS = [*TINY, "checkpoint.interval=2", "checkpoint.async_save=false", "eval.interval=2",
        "eval.batches=2", "mesh.axes.data.size=1", "mesh.axes.fsdp.size=2"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_export")
    run, out = tmp / "run", tmp / "hf"
    result = run_cli(train_command(run, SETS, steps=2, framework="torch", nprocs=2))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert main(["export", str(run), "--to", "safetensors", "--out", str(out)]) == 0
    return run, out


def test_plain_torch_on_the_export_gives_the_runs_eval_loss(exported):
    run, out = exported
    spec = load_spec(run / "spec.toml")
    params, model = export.read(out)
    assert model == spec.model
    assert json.loads((out / "config.json").read_text())["step"] == 2
    initial = params_file.read(run, spec.model)  # training moved every kernel
    assert not np.array_equal(params["block_0/query/kernel"], initial["block_0/query/kernel"])
    module = Transformer(model)
    module.load_state_dict(from_flax(module, params_file.unflatten(params)))
    data, sums = reference_batches(spec), []
    with torch.no_grad():
        for index in range(spec.eval.batches):
            batch = {k: torch.from_numpy(v) for k, v in data.batch(index).items()}
            loss, tokens = next_token_loss(module(batch["inputs"].long()), batch["targets"],
                                           batch["mask"])
            sums.append((float(loss), float(tokens)))
    [recorded] = [r["eval_loss"] for r in read_records(run) if r["step"] == 2]
    # the run evaluated the same float32 weights on 2 ranks: summation order differs
    assert sum(s for s, _ in sums) / sum(t for _, t in sums) == pytest.approx(recorded, rel=1e-5)


def test_flax_gives_the_same_logits(exported):
    _, out = exported
    params, model = export.read(out)
    tree = params_file.unflatten(params)
    tokens = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % model.vocab_size
    flax_logits = np.asarray(jax.jit(FlaxTransformer(model).apply)({"params": tree}, tokens))
    module = Transformer(model)
    module.load_state_dict(from_flax(module, tree))
    with torch.no_grad():
        torch_logits = module(torch.from_numpy(tokens).long()).numpy()
    np.testing.assert_allclose(torch_logits, flax_logits, rtol=1e-5, atol=1e-5)
