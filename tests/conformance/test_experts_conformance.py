"""The conformance suite's `experts` family: the JAX implementation passes it (the first step
against the float64 MoE forward, which drops assignments at this capacity; the expert axis
against the experts whole), and a router whose capacity drops the later rows' assignments
first, every choice otherwise the same, fails it at the first step's loss."""
import pytest

import trainspec.jax.models.moe
from trainspec.core import golden as golden_file, moe_reference, reference_train as ref
from trainspec.core.conformance_experts import EXPERT_CASES, EXPERT_JOB, experts_row
from trainspec.jax.conformance import JaxConformance

pytestmark = pytest.mark.slow


def test_the_reference_drops_assignments_at_the_job_s_capacity():
    job = golden_file.spec("adamw", EXPERT_JOB)
    start = ref.initial_params(job.model, job.seed)
    _, dropped = moe_reference.loss(start, golden_file.load().batches[0], job.model.moe)
    assert dropped > 0


def test_jax_passes_the_experts_family():
    row = experts_row(JaxConformance("xla"))
    assert (row.passed, row.failed, row.refused) == (len(EXPERT_CASES), 0, []), row


def test_a_router_dropping_the_wrong_assignments_fails_it(monkeypatch):
    route = trainspec.jax.models.moe.route

    def later_rows_first(logits, *args):
        routed = route(logits[::-1], *args)
        return {**routed, "weights": routed["weights"][::-1]}

    monkeypatch.setattr(trainspec.jax.models.moe, "route", later_rows_first)
    row = experts_row(JaxConformance("xla"))
    assert row.failed == len(EXPERT_CASES), row
    assert row.first_failure.startswith("experts whole: step 1: loss "), row.first_failure
