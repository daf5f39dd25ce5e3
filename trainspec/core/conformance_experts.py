"""The conformance suite's `experts` family: the conformance job with every block's MLP a
mixture of experts (`EXPERT_JOB`: 4 experts, 2 per token, capacity-limited so that the drop
order matters), from trainspec.core.reference_train.initial_params of that model, on the
shipped batches.

- Every case's first-step loss, auxiliary losses included, against the float64 NumPy forward
  (trainspec/core/moe_reference.py: the core's routing, drops and combine): a router that
  picks, gates or drops other assignments, or combines outputs in another order, changes it.
- Every case's losses and updated parameters over the job's steps against the
  implementation's own run with the experts whole on every device (the first case): an
  expert axis moves experts, not the step's result.
The suite ships no float64 gradient of the MoE model, so the later steps are checked against
the implementation itself, as the pipeline family is.
"""
from __future__ import annotations

from trainspec.core import golden as golden_file, moe_reference, reference_train as ref
from trainspec.core.conformance import Row
from trainspec.core.conformance_steps import (
    LOSS_RTOL, SELF_RTOL, _relative, _train, against_itself, refusal)

EXPERT_JOB = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.capacity_factor=1.0",
              "metrics.gns=false"]
EXPERT_CASES = {"experts whole": [], "data x expert": ["mesh.axes.expert.size=2"]}


def _problem(steps: list, want_loss: float, base: list | None, start: dict) -> str | None:
    loss = steps[0][0]
    if not _relative(loss, want_loss) <= LOSS_RTOL:
        return f"step 1: loss {loss:.7g}, the float64 reference {want_loss:.7g}"
    if base is None:
        return None
    for i, ((got, _, _), (want, _, _)) in enumerate(zip(steps, base), 1):
        if not _relative(got, want) <= SELF_RTOL:
            return f"step {i}: loss {got:.7g}, {want:.7g} with the experts whole"
    return against_itself(steps, base, start)


def experts_row(adapter) -> Row:
    row, base = Row("experts"), None
    batches = golden_file.load().batches
    job = golden_file.spec("adamw", EXPERT_JOB)
    start = ref.initial_params(job.model, job.seed)
    want_loss, _ = moe_reference.loss(start, batches[0], job.model.moe)
    for case, sets in EXPERT_CASES.items():
        spec = golden_file.spec("adamw", [*EXPERT_JOB, *sets])
        refused = refusal(adapter, spec)
        if refused:
            row.refused.append(f"{case}: {refused}")
            continue
        steps, problem = _train(adapter, spec, start, batches)
        problem = problem or _problem(steps, want_loss, base, start)
        if base is None and problem is None:
            base = steps
        problem = next((p for p in adapter.gather_objects(problem) if p), None)
        row.add(problem is None, f"{case}: {problem}")
    if row.refused and not row.passed + row.failed:  # an implementation without experts
        row.skipped = f"its capability table refuses every case: {row.refused[0]}"
    return row
