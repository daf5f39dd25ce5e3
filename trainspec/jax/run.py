"""The run services for a user's own loop around a wrapped JAX step (its engine in the run loop:
trainspec.jax.engine):

    step = trainspec.jax.wrap(loss_step(loss_fn), spec)
    with trainspec.jax.Run(spec, "runs/mine", step, steps=100) as run:
        state = run.resume(init_fn, rng)          # newest good checkpoint, else step.init(...)
        for batch in run.batches(batch_at):       # batch_at(i): batch i, a pure function of i
            state, metrics = step(state, batch)
            state = run.after_step(state, metrics)
    print(run.summary())

The records, checkpoints (orbax, trainspec.jax.checkpoint), progress bar and summary are those
of `trainspec train` (docs/wrapping.md, "Run services for your own loop").
"""
from __future__ import annotations

from pathlib import Path

import jax

from trainspec.core import run as core_run
from trainspec.core.flops import ModelFlops
from trainspec.jax.checkpoint import Checkpointer
from trainspec.jax.engine import JaxEngine
from trainspec.jax.step import WrappedStep


def abstract_state(wrapped: WrappedStep, init_fn, *args):
    """Shapes, dtypes and planned shardings of `init_fn(*args)`'s state: nothing computed."""
    from trainspec.jax.layout import strip_boxes

    boxed = wrapped.plan(init_fn, *args)
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=sharding), strip_boxes(boxed), wrapped.state_shardings)


class Run(core_run.Run):
    """The run services (trainspec.core.run.Run) for a user's own loop around `step`, a
    WrappedStep: orbax checkpoints in `run_dir`, the spec's metrics sinks, progress, summary.
    `steps` defaults to `train.steps`; `schedule(updates)` and `model_flops` fill the records'
    learning rate and MFU; `eval_data(i)`, eval batch i (this process's rows) under `[eval]`.
    Other options as trainspec.core.run.Run."""

    def __init__(self, spec, run_dir, step: WrappedStep, steps: int | None = None, *,
                 schedule=None, model_flops: ModelFlops | None = None, eval_data=None,
                 **options):
        run_dir = Path(run_dir)
        super().__init__(spec, run_dir, Checkpointer(spec, run_dir), steps or spec.train.steps,
                         **options)
        self.jax_step = JaxEngine(step, model_flops, schedule, eval_data)

    def _resume_job(self, init_fn, *args):
        """`resume(init_fn, *args)`: the newest good checkpoint, restored straight into the
        step's planned shardings, or, only when there is none, `step.init(init_fn, *args)`.
        `init_fn` is required: it is what the planned shardings are read from."""
        if init_fn is None:
            raise TypeError("trainspec.jax.Run.resume(init_fn, *args): init_fn is required "
                            "(the step plans its state's layout from it)")
        wrapped = self.jax_step.wrapped
        return (self.jax_step, abstract_state(wrapped, init_fn, *args),
                lambda: wrapped.init(init_fn, *args))
