"""Runs tests/torch/torch_sequence_worker.py on 4 gloo ranks: each layout's per-step records."""
import json
import os
import subprocess
import sys
from pathlib import Path

from trainspec.core.spec import DEFAULT_SPEC_PATH

HERE = Path(__file__).resolve().parent
RANKS = 4


def run_layouts(tmp: Path, layouts: dict[str, list[str]], steps: int,
                params: Path | None = None, broken: dict | None = None) -> dict[str, dict]:
    """{name: {"loss": [...], "grad_norm": [...], aux keys...}} of each layout, trained in
    turn by one 4-rank job from `params` (a flat .npz) or the seeded draws; `broken`:
    {layout: a wrong implementation the worker runs it with (its BREAKAGES)}."""
    job = {"spec": str(DEFAULT_SPEC_PATH), "steps": steps, "out": str(tmp / "torch.json"),
           "layouts": layouts, "params": str(params) if params else None,
           "broken": broken or {}}
    (tmp / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", str(RANKS), "--",
         sys.executable, str(HERE / "torch_sequence_worker.py"), str(tmp / "job.json")],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((tmp / "torch.json").read_text())
