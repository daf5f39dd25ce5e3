"""One rank of test_wrong_impls_torch.py: two conformance cases on torch, as
`trainspec conformance --impl torch` runs them, right and then deliberately wrong:
- the `experts` family, then with a router whose capacity drops the later rows' assignments
  first;
- the `data x context` layout case against the shipped float64 trajectory, then with a ring
  that scores each key/value block under the next block's positions (its causal mask one
  block off).
Rank 0 writes {"experts": {"right", "broken"}, "context": {"right", "broken"}} to `out`.
"""
import dataclasses
import json
import sys
from pathlib import Path

import trainspec.torch.context as context
import trainspec.torch.models.moe as moe
from trainspec.core import golden as golden_file, reference_train as ref
from trainspec.core.conformance_experts import experts_row
from trainspec.core.conformance_steps import LAYOUTS, _train, against_reference
from trainspec.torch.conformance import TorchConformance


def later_rows_first(route):
    def routed(logits, *args):
        wrong = route(logits.flip(0), *args)
        return {**wrong, "weights": wrong["weights"].flip(0)}
    return routed


def context_case(adapter) -> str | None:
    """The first way the data x context case differs from the shipped trajectory, or None."""
    shipped, job = golden_file.load(), golden_file.spec()
    start = ref.initial_params(job.model, job.seed)
    spec = golden_file.spec("adamw", LAYOUTS["data x context"])
    steps, problem = _train(adapter, spec, start, shipped.batches)
    return problem or against_reference(steps, shipped.trajectories["adamw"], start)


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    adapter = TorchConformance()
    adapter.join()
    out = {"experts": {"right": dataclasses.asdict(experts_row(adapter))},
           "context": {"right": context_case(adapter)}}
    moe.route = later_rows_first(moe.route)
    out["experts"]["broken"] = dataclasses.asdict(experts_row(adapter))
    context.held_block = lambda rank, step, n: (rank - step + 1) % n
    out["context"]["broken"] = context_case(adapter)
    if adapter.is_writer():
        Path(job["out"]).write_text(json.dumps(out))
    adapter.leave()


if __name__ == "__main__":
    main(sys.argv[1])
