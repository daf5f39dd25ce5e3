"""Runs tests/torch/torch_sequence_worker.py on 4 gloo ranks: each layout's per-step records."""
import json
from pathlib import Path

from rank_jobs import launch_worker
from trainspec.core.spec import DEFAULT_SPEC_PATH

RANKS = 4


def run_layouts(tmp: Path, layouts: dict[str, list[str]], steps: int,
                params: dict[str, Path] | None = None, broken: dict | None = None
                ) -> dict[str, dict]:
    """{name: {"loss": [...], "grad_norm": [...], aux keys...}} of each layout, trained in
    turn by one 4-rank job from its `params` entry (a flat .npz) or else the seeded draws;
    `broken`: {layout: a wrong implementation the worker runs it with (its BREAKAGES)}."""
    job = {"spec": str(DEFAULT_SPEC_PATH), "steps": steps, "out": str(tmp / "torch.json"),
           "layouts": layouts, "params": {k: str(v) for k, v in (params or {}).items()},
           "broken": broken or {}}
    (tmp / "job.json").write_text(json.dumps(job))
    launch_worker(Path(__file__).resolve().parent / "torch_sequence_worker.py",
                  tmp / "job.json", RANKS)
    return json.loads((tmp / "torch.json").read_text())
