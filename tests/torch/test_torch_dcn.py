"""`mesh.axes.*.dcn` on torch (trainspec.torch.mesh.rank_grid): ranks numbered host by host
are laid out host-major across hosts (the core's hybrid layout, as JAX's), row-major on one
host; a job over two simulated hosts (LOCAL_WORLD_SIZE=2 on 4 gloo ranks) with the fsdp axis
across them trains the single-host job's losses."""
import os

import numpy as np

from cli_runs import read_records, run_cli_ok, train_command
from tiny import TINY, tiny_spec
from trainspec.torch.mesh import rank_grid

FSDP_ACROSS = ["mesh.axes.data.size=2", "mesh.axes.fsdp.size=2", "mesh.axes.fsdp.dcn=2"]


def test_the_axis_across_hosts_takes_one_rank_of_each():
    spec = tiny_spec(*FSDP_ACROSS)
    # host 0 holds ranks 0, 1 (its block: data 2 x fsdp 1), host 1 ranks 2, 3 (tensor: 1)
    np.testing.assert_array_equal(rank_grid(spec, [0, 0, 1, 1])[..., 0], [[0, 2], [1, 3]])
    np.testing.assert_array_equal(rank_grid(spec, [0, 0, 0, 0])[..., 0], [[0, 1], [2, 3]])  # one host
    data_across = tiny_spec("mesh.axes.data.size=2", "mesh.axes.data.dcn=2",
                            "mesh.axes.fsdp.size=2")
    np.testing.assert_array_equal(rank_grid(data_across, [0, 0, 1, 1])[..., 0], [[0, 1], [2, 3]])


def _losses(run_dir, sets, env=None):
    cmd = train_command(run_dir, [*TINY, "checkpoint.interval=0", "metrics.interval=1", *sets],
                        steps=3, framework="torch", nprocs=4)
    run_cli_ok(cmd, env={**os.environ, **(env or {})})
    return [r["loss"] for r in read_records(run_dir)]


def test_two_hosts_train_the_one_host_losses(tmp_path):
    across = _losses(tmp_path / "hosts", FSDP_ACROSS, {"LOCAL_WORLD_SIZE": "2"})
    one = _losses(tmp_path / "one", FSDP_ACROSS[:2])
    np.testing.assert_allclose(across, one, rtol=1e-6)  # the same sums, other members' order
