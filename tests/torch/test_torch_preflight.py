"""`health.preflight = true` on torch (trainspec/torch/preflight.py): a healthy device's matmuls
pass their rounding bounds; a rank whose all-reduce values arrive wrong (the planted
Faults.faulty_reduction) is named in one line, left out, and the rest train on the mesh that
fits them; healthy ranks all pass and train on all of them."""
import os

import torch

from cli_runs import read_summary, run_cli_ok, train_command
from tiny import TINY
from trainspec.torch.preflight import matmul_failures

SETS = [*TINY, "checkpoint.interval=0", "health.preflight=true"]


def _train(run_dir, nprocs, env=None):
    cmd = train_command(run_dir, SETS, steps=3, framework="torch", nprocs=nprocs)
    out = run_cli_ok(cmd, env={**os.environ, **(env or {})})
    return out, read_summary(run_dir)


def test_a_healthy_device_passes_the_matmuls():
    assert matmul_failures(torch.device("cpu")) == []


def test_a_rank_with_a_faulty_reduction_is_named_once_and_left_out(tmp_path):
    out, summary = _train(tmp_path, 4, {"TRAINSPEC_FAULTS": '{"faulty_reduction": [2, 128]}'})
    line = ("trainspec: preflight: rank 2 failed 2 check(s) (first: all-reduce over the job: "
            "104 of 1000 sums wrong, from ranks [2]); excluded")
    assert out.count(line) == 1, out
    assert summary["preflight"]["excluded"] == [2] and summary["preflight"]["checked"] == 4
    assert summary["preflight"]["failures"]["2"][1].startswith("all-reduce over axis data: ")
    assert summary["excluded_devices"] == [2] and summary["mesh"]["data"] == 2  # 3 do not split 16
    assert "rank 2 left the job (excluded; it failed the preflight checks)" in out
    assert summary["badput_s"]["initialization"] >= summary["preflight"]["seconds"]


def test_healthy_ranks_all_pass_and_train(tmp_path):
    out, summary = _train(tmp_path, 2)
    assert summary["preflight"]["excluded"] == [] and summary["preflight"]["failures"] == {}
    assert summary["mesh"]["data"] == 2 and "preflight:" not in out
