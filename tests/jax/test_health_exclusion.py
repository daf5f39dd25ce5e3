"""Device exclusion: the largest mesh the spec allows without the bad devices; resume there."""
import json

import jax
import pytest

from trainspec.cli.main import main
from trainspec.core.errors import UserInputError
from trainspec.core.exclusion import exclude
from trainspec.jax.health.exclusion import largest_mesh

from tiny import tiny_spec


def _shape(mesh):
    return dict(mesh.shape)


@pytest.mark.parametrize("overrides, excluded, shape", [
    ((), [3], {"data": 4, "fsdp": 1, "tensor": 1}),        # 7 left; micro 16 splits over 4
    (("mesh.axes.fsdp.size=2",), [0], {"data": 2, "fsdp": 2, "tensor": 1}),
    (("batch.micro_batch=12", "batch.global_batch=12"), [7, 6], {"data": 6, "fsdp": 1, "tensor": 1}),
])
def test_largest_mesh_without_excluded(overrides, excluded, shape):
    mesh = largest_mesh(exclude(tiny_spec(*overrides), excluded))
    assert _shape(mesh) == shape
    assert not {d.id for d in mesh.devices.flat} & set(excluded)


def test_fixed_sizes_cannot_shrink():
    spec = exclude(tiny_spec("mesh.axes.data.size=4", "mesh.axes.fsdp.size=2"), [1])
    with pytest.raises(UserInputError, match="mesh.axes: .*7 are available"):
        largest_mesh(spec)


def test_without_exclusions_a_misfit_spec_is_an_error_not_a_smaller_mesh():
    with pytest.raises(UserInputError, match="not divisible"):
        largest_mesh(tiny_spec("mesh.axes.fsdp.size=3"))


def test_cli_exclude_devices_resumes_from_the_checkpoint(tmp_path):
    sets = [a for s in ("model.d_model=32", "model.d_ff=64", "model.n_layers=1",
                        "model.n_heads=2", "batch.seq_len=16", "batch.global_batch=16",
                        "batch.micro_batch=16", "checkpoint.interval=3",
                        "checkpoint.async_save=false") for a in ("--set", s)]
    common = ["train", "--quiet", "--run-dir", str(tmp_path), "--summary-json",
              str(tmp_path / "s.json"), *sets]
    assert main([*common, "--steps", "6"]) == 0
    assert main([*common, "--steps", "9", "--exclude-devices", "2,5"]) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["resumed_from"] == 6 and summary["excluded_devices"] == [2, 5]
    assert summary["mesh"]["data"] == 4 and summary["final_loss"] > 0
    assert main([*common, "--exclude-devices", "x"]) == 2
