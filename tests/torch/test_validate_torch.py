"""`trainspec validate --framework torch` shows the layout the torch implementation will give a
model without starting ranks (trainspec/torch/describe.py): every parameter's split and rank 0's
block equal what 4 gloo ranks hold once trainspec.torch.wrap has laid the model out, for the
reference model under fsdp x tensor (FSDP2's strided split of a tensor-split weight) and
data x fsdp, and for a user's model (examples/own_torch_model.py) under fsdp=4."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import TINY
from trainspec.cli.main import main
from trainspec.core import user_model
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.torch.describe import parameter_layout
from trainspec.torch.models.transformer import Transformer
from trainspec.torch.support import check_layout

HERE = Path(__file__).resolve().parent
OWN = str(HERE.parents[1] / "examples" / "own_torch_model.py") + ":make"


def mesh(data, fsdp, tensor):
    return [f"mesh.axes.data.size={data}", f"mesh.axes.fsdp.size={fsdp}",
            f"mesh.axes.tensor.size={tensor}"]


LAYOUTS = {
    "fsdp2_tensor2": [None, [*TINY, *mesh(1, 2, 2)]],
    "data2_fsdp2": [None, [*TINY, *mesh(2, 2, 1)]],
    "own_fsdp4": [OWN, [*TINY, *mesh(1, 4, 1)]],
}


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    (tmp / "job.json").write_text(json.dumps({"layouts": LAYOUTS, "out": str(tmp / "out.json")}))
    cmd = [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", "4", "--",
           sys.executable, str(HERE / "torch_layout_worker.py"), str(tmp / "job.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_validate_says_what_the_ranks_hold(held, layout):
    reference, overrides = LAYOUTS[layout]
    spec = load_spec(DEFAULT_SPEC_PATH, overrides)
    with torch.device("meta"):
        if reference is None:
            model, units = Transformer(spec.model), ("blocks.*",)
        else:
            model, units = user_model.load(reference, spec).init(), None
    said = {name: [splits, list(local)]
            for name, _, splits, local in parameter_layout(check_layout(spec, 4), model, units)}
    assert said == held[layout]
    assert any(len(splits) == 2 for splits, _ in said.values()) == (layout == "fsdp2_tensor2")


def test_the_cli_prints_it_without_starting_ranks(capsys):
    sets = [a for s in [*TINY, *mesh(1, 2, 2)] for a in ("--set", s)]
    assert main(["validate", str(DEFAULT_SPEC_PATH), "--framework", "torch", "--nprocs", "4",
                 *sets]) == 0
    out = capsys.readouterr().out
    assert "mesh: data=1 x fsdp=2 x tensor=2" in out
    # d_model 32, d_ff 64: mlp_out (32, 64) split on dim 1 by tensor, then dim 0 by fsdp
    assert re.search(r"blocks\.block_0\.mlp_out\.weight +\(32, 64\) +dim 1 over tensor, "
                     r"dim 0 over fsdp +rank 0 holds \(16, 32\)", out), out


def test_a_refused_field_is_one_line(capsys):
    sets = [a for s in [*TINY, "layout.rules.embed=['fsdp']"] for a in ("--set", s)]
    assert main(["validate", str(DEFAULT_SPEC_PATH), "--framework", "torch", *sets]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().startswith("trainspec: error: layout.rules:"), captured.err
    assert "valid" not in captured.out


@pytest.mark.parametrize("flags,says", [
    (["--framework", "torch", "--host-devices", "2"], "--host-devices: a JAX flag"),
    (["--nprocs", "2"], "--nprocs: only with --framework torch"),
])
def test_a_flag_of_the_other_framework_is_one_line(capsys, flags, says):
    assert main(["validate", str(DEFAULT_SPEC_PATH), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"trainspec: error: {says}") and "\n" not in err, err
