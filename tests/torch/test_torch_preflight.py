"""`health.preflight = true` on torch (trainspec/torch/preflight.py): a healthy device's matmuls
pass their rounding bounds; a rank whose all-reduce values arrive wrong (the planted
Faults.faulty_reduction) is named in one line, left out, and the rest train on the mesh that
fits them; healthy ranks all pass and train on all of them."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tiny import TINY
from trainspec.torch.preflight import matmul_failures

ROOT = Path(__file__).resolve().parents[2]
SETS = [*TINY, "checkpoint.interval=0", "health.preflight=true"]


def _train(run_dir, nprocs, env=None):
    sets = [a for s in SETS for a in ("--set", s)]
    cmd = [sys.executable, "-m", "trainspec.cli.main", "train", "--framework", "torch",
           "--nprocs", str(nprocs), "--quiet", "--steps", "3", "--run-dir", str(run_dir),
           "--summary-json", str(run_dir / "summary.json"), *sets]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr, json.loads((run_dir / "summary.json").read_text())


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
