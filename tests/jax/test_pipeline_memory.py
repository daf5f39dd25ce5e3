"""1F1B holds at most p micro-batches of activations per stage where GPipe holds m, in the
compiled program: XLA's memory analysis of the pipelined loss's gradient under each schedule
differs by exactly the inputs the schedules keep in flight (trainspec.core.pipeline.ticks)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from trainspec.core.pipeline.schedule import run
from trainspec.core.pipeline.ticks import tables
from trainspec.core.spec import load_spec
from trainspec.jax.pipeline import pipelined_loss
from trainspec.jax.train import build_job

P, M, DATA, ROWS, LENGTH, WIDTH = 2, 8, 4, 32, 64, 32
pytestmark = pytest.mark.slow  # two pipelined gradients compiled


def temp_bytes(schedule: str) -> int:
    spec = load_spec(None, [
        "model.n_layers=2", f"model.d_model={WIDTH}", "model.n_heads=4", "model.d_ff=64",
        f"batch.seq_len={LENGTH}", f"batch.global_batch={ROWS}", f"batch.micro_batch={ROWS}",
        f"pipeline.microbatches={M}", f'pipeline.schedule="{schedule}"',
        f'mesh.axes={{stage={{role="pipeline",size={P}}},data={{size={DATA}}}}}'])
    job = build_job(spec, init=False)
    loss_fn = pipelined_loss(job.model, spec, P, "stage")
    tokens = jax.ShapeDtypeStruct((ROWS, LENGTH), np.int32, sharding=job.step.batch_sharding(2))
    batch = {"inputs": tokens, "targets": tokens,
             "mask": jax.ShapeDtypeStruct((ROWS, LENGTH), np.float32,
                                          sharding=job.step.batch_sharding(2))}
    with job.step.context():
        compiled = jax.jit(jax.grad(lambda p, b: loss_fn(p, b)[0])).lower(
            job.abstract_state.params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_keeps_p_inputs_in_flight_where_gpipe_keeps_m():
    in_flight = {s: tables(run(s, P, M)).activation_slots for s in ("gpipe", "1f1b")}
    assert in_flight == {"gpipe": M, "1f1b": P}
    # one pipeline micro-batch's input on one device: its rows of one data shard, float32
    per_input = (ROWS // M // DATA) * LENGTH * WIDTH * 4
    saved = temp_bytes("gpipe") - temp_bytes("1f1b")
    assert saved == pytest.approx((M - P) * per_input, rel=0.1), (saved, per_input)
