"""The conformance suite's `pipeline` family (trainspec.core.conformance_steps.pipeline_row)
fails a pipeline that drops the last pipeline micro-batch's gradient (its loss still counted,
so the step's first loss is right), naming the case. The JAX pipeline passes it:
tests/conformance/test_jax_steps.py."""
from __future__ import annotations

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

from trainspec.core import golden
from trainspec.core.conformance_steps import pipeline_row
from trainspec.jax.conformance import JaxConformance
from trainspec.jax.pipeline import pipelined_loss

pytestmark = pytest.mark.slow  # the 2-layer job compiled with and without a pipeline


def dropping_last_micro_batch(model, spec, stages, axis):
    """The right pipeline's loss, with the gradient of the last pipeline micro-batch (rows
    m - 1, 2m - 1, ...) stopped: a pipeline whose last backward never reaches the stages."""
    right = pipelined_loss(model, spec, stages, axis)
    m = spec.pipeline.microbatches or stages

    def loss_fn(params, batch):
        rows = batch["mask"].shape[0]
        last = (jnp.arange(rows) % m == m - 1)[:, None].astype(batch["mask"].dtype)
        kept, _, _ = right(params, {**batch, "mask": batch["mask"] * (1 - last)})
        dropped, _, _ = right(params, {**batch, "mask": batch["mask"] * last})
        _, tokens, aux = right(params, batch)
        return kept + jax.lax.stop_gradient(dropped), tokens, aux

    return dataclasses.replace(right, fn=loss_fn)  # still a pipelined loss to the step


class DropsLastMicroBatch(JaxConformance):
    def train_steps(self, spec, params, batches):
        with mock.patch("trainspec.jax.train.pipelined_loss", dropping_last_micro_batch):
            return super().train_steps(spec, params, batches)


def test_a_pipeline_that_drops_a_micro_batch_s_gradient_fails():
    wrong = pipeline_row(DropsLastMicroBatch(), golden.load().batches)
    assert wrong.failed == 1 and wrong.first_failure.startswith("pipeline x data: step "), wrong
