"""One rank of the conformance suite's `pipeline` family on the torch implementation
(test_torch_pipeline_conformance.py), under `trainspec launch --nprocs 4`: the family's row for
the torch pipeline as it is, then for one whose last pipeline micro-batch's loss carries no
gradient (its loss still counted, so the step's first loss is right). Rank 0 prints one
`RESULT` line per implementation: passed, failed and the first failure."""
from __future__ import annotations

import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from trainspec.core import golden  # noqa: E402
from trainspec.core.conformance_steps import pipeline_row  # noqa: E402
from trainspec.torch import train  # noqa: E402
from trainspec.torch.conformance import TorchConformance  # noqa: E402
from trainspec.torch.pipeline import PipelineIO  # noqa: E402


def dropping_the_last_micro_batch(right: PipelineIO, microbatches: int) -> PipelineIO:
    """`right`, except that every m-th loss the schedule asks for (each accumulation
    micro-batch's last pipeline micro-batch) is cut from the graph: its backward sends no
    gradient to the stages."""
    calls = [0]

    def loss(output, target):
        calls[0] += 1
        value = right.loss(output, target)
        if calls[0] % microbatches:
            return value
        return value.detach() + 0.0 * output.sum()  # counted, but no gradient

    return PipelineIO(right.inputs, right.target, loss, right.tokens)


def main() -> None:
    adapter = TorchConformance()
    adapter.join()
    batches = golden.load().batches
    rows = {"torch": pipeline_row(adapter, batches)}
    with mock.patch.object(train, "REFERENCE_PIPELINE",
                           dropping_the_last_micro_batch(train.REFERENCE_PIPELINE, 2)):
        rows["drops_last_micro_batch"] = pipeline_row(adapter, batches)
    if torch.distributed.get_rank() == 0:
        for name, row in rows.items():
            print(f"RESULT impl={name} passed={row.passed} failed={row.failed} "
                  f"refused={len(row.refused)} first_failure={row.first_failure}", flush=True)
    adapter.leave()


if __name__ == "__main__":
    main()
