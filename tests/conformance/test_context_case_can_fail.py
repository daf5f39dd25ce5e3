"""The conformance suite's `data x context` case fails an implementation whose causal mask
is one block off: JAX's ring with every query treated as one chunk later than it is, against
the float64 reference trajectory the suite ships, as step_rows checks each layout case."""
import pytest

import trainspec.jax.context
from trainspec.core import golden as golden_file, reference_train as ref
from trainspec.core.conformance_steps import LAYOUTS, _train, against_reference
from trainspec.jax.conformance import JaxConformance

pytestmark = pytest.mark.slow


def test_a_mask_one_block_off_fails_the_data_x_context_case(monkeypatch):
    spec = golden_file.spec("adamw", LAYOUTS["data x context"])
    merge = trainspec.jax.context._merge
    chunk = spec.batch.seq_len // 4  # context 2: the zig-zag's 4 chunks

    def one_block_late(state, q, k, v, q_pos, k_pos, scale):
        return merge(state, q, k, v, q_pos + chunk, k_pos, scale)

    monkeypatch.setattr(trainspec.jax.context, "_merge", one_block_late)
    shipped = golden_file.load()
    start = ref.initial_params(golden_file.spec().model, golden_file.spec().seed)
    steps, problem = _train(JaxConformance("xla"), spec, start, shipped.batches)
    assert problem is None, problem
    failure = against_reference(steps, shipped.trajectories["adamw"], start)
    assert failure is not None and failure.startswith("step 1: loss "), failure
