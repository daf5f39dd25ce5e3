"""One rank of test_experts_conformance_torch.py: the conformance suite's `experts` family on
torch, as `trainspec conformance --impl torch` runs it, then again with a router whose
capacity drops the later rows' assignments first. Rank 0 writes both rows to JOB.json's `out`.
"""
import dataclasses
import json
import sys
from pathlib import Path

import trainspec.torch.models.moe as moe
from trainspec.core.conformance_experts import experts_row
from trainspec.torch.conformance import TorchConformance


def later_rows_first(route):
    def routed(logits, *args):
        wrong = route(logits.flip(0), *args)
        return {**wrong, "weights": wrong["weights"].flip(0)}
    return routed


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    adapter = TorchConformance()
    adapter.join()
    rows = {"right": dataclasses.asdict(experts_row(adapter))}
    moe.route = later_rows_first(moe.route)
    rows["broken"] = dataclasses.asdict(experts_row(adapter))
    if adapter.is_writer():
        Path(job["out"]).write_text(json.dumps(rows))
    adapter.leave()


if __name__ == "__main__":
    main(sys.argv[1])
