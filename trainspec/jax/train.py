"""The default training job: the reference transformer on the embedded corpus, under a spec.

`build_job` assembles model, optimizer, data and the wrapped step; `run` trains it in the run
loop of every implementation (trainspec.core.loop), as `trainspec train` does. The loop syncs
with the device only at the metrics interval.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from trainspec.core import evaluation
from trainspec.core.data import ByteBatches
from trainspec.core.errors import UserInputError
from trainspec.core.faults import Faults
from trainspec.core.loop import train
from trainspec.core.mesh import resolve_mesh, usable_ids
from trainspec.core.run import Run
from trainspec.core.run_files import write_json_atomically
from trainspec.core.spec import Spec
from trainspec.core.transformer_flops import for_spec as model_flops
from trainspec.core.user_model import UserModel
from trainspec.jax.capabilities import JAX
from trainspec.jax.checkpoint import Checkpointer
from trainspec.jax.context import attention_for, split_sequence
from trainspec.jax.runtime import is_writer
from trainspec.jax.feed import local_rows
from trainspec.core.exclusion import exclude
from trainspec.jax.health.exclusion import largest_mesh
from trainspec.jax.health.faults import faulty_reduction
from trainspec.jax.health.memory import check_host_batch
from trainspec.jax.health.preflight import preflight
from trainspec.jax.models.moe import moe_losses_and_stats
from trainspec.jax.models.transformer import Transformer, next_token_loss
from trainspec.jax.pipeline import pipelined_loss
from trainspec.jax.pipeline_params import whole_abstract, whole_arrays
from trainspec.jax.params_file import placed, save_initial, with_values
from trainspec.jax.engine import JaxEngine
from trainspec.jax.run import abstract_state
from trainspec.jax.step import WrappedStep
from trainspec.jax.step_forms import loss_step
from trainspec.jax.wrapping import wrap


def make_schedule(spec: Spec, total_steps: int) -> optax.Schedule:
    """Learning rate by update count: linear warm-up from 0, cosine decay to a tenth."""
    o = spec.optimizer
    return optax.warmup_cosine_decay_schedule(
        0.0, o.learning_rate, min(o.warmup_steps, total_steps - 1), max(total_steps, 2),
        end_value=o.learning_rate * 0.1,
    )


def make_optimizer(spec: Spec, total_steps: int) -> optax.GradientTransformation:
    o = spec.optimizer
    schedule = make_schedule(spec, total_steps)
    opt = (
        optax.adamw(schedule, weight_decay=o.weight_decay)
        if o.name == "adamw"
        else optax.sgd(schedule, momentum=0.9)
    )
    return optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), opt) if o.grad_clip_norm else opt


@dataclasses.dataclass
class Job:
    """The wrapped step with its state planned. `state` is built by `init_state()` (or comes
    from a checkpoint restored into `abstract_state`), never both."""

    spec: Spec
    model: Transformer
    step: WrappedStep
    data: ByteBatches
    abstract_state: Any  # shapes, dtypes and target shardings of the state: nothing computed
    init_fn: Any
    state: Any = None

    @property
    def mesh_shape(self) -> dict[str, int]:
        return self.step.dims.shape

    def init_state(self, initial: dict[str, np.ndarray] | None = None):
        """A fresh state, initialised sharded (it is never whole on one device); its
        parameters those of `initial` (by path: trainspec.core.params_file) when given."""
        rng = jax.random.key(self.spec.seed)
        if initial is None:
            self.state = self.step.init(self.init_fn, rng)
        else:
            self.state = self.step.init(self.init_fn, rng,
                                        placed(whole_abstract(self.abstract_state.params), initial))
        return self.state


def _pipeline_stages(spec: Spec) -> int:
    """The pipeline axis's size, an inferred one resolved for this process's devices."""
    axes = spec.mesh.axes_with_role("pipeline")
    if not axes:
        return 1
    size = spec.mesh.axes[axes[0]].size
    return size if size != -1 else resolve_mesh(spec, len(usable_ids(
        spec, [d.id for d in jax.devices()]))).stages


def _components(spec: Spec, total_steps: int):
    model = Transformer(
        spec.model,
        dtype=jnp.dtype(spec.precision.compute),
        param_dtype=jnp.dtype(spec.precision.param),
        remat=spec.remat.policy,
        attention=attention_for(spec),
    )

    def loss_fn(params, batch):
        batch = split_sequence(spec, batch)  # the context axes' order; a sum over tokens
        if spec.model.moe is None:
            logits = model.apply({"params": params}, batch["inputs"])
            return (*next_token_loss(logits, batch["targets"], batch["mask"]), {})
        logits, sown = model.apply({"params": params}, batch["inputs"], mutable=["moe"])
        loss_sum, tokens = next_token_loss(logits, batch["targets"], batch["mask"])
        aux_per_token, stats = moe_losses_and_stats(sown["moe"], spec.model.moe)
        return loss_sum + aux_per_token * tokens, tokens, stats

    stages = _pipeline_stages(spec)
    if stages > 1:  # the blocks as a pipeline over the pipeline axis (trainspec.jax.pipeline)
        loss_fn = pipelined_loss(model, spec, stages, spec.mesh.axes_with_role("pipeline")[0])

    tx = make_optimizer(spec, total_steps)

    def init_state(rng, values=None):
        """`values`: the parameters to start from (a --init-from file's, placed), in place of
        the seeded draws, which XLA then leaves out of the program as unused."""
        tokens = jnp.zeros((1, spec.batch.seq_len), jnp.int32)
        params = model.init(rng, tokens)["params"]
        if values is not None:
            params = with_values(params, values)
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return model, loss_fn, init_state


def build_abstract_job(spec: Spec, mesh=None):
    """(wrapped step with its state shardings planned, abstract state): nothing is computed."""
    job = build_job(spec, mesh, init=False)
    return job.step, job.abstract_state


def build_job(spec: Spec, mesh=None, total_steps: int | None = None, init: bool = True) -> Job:
    """The reference job; its state initialised unless `init` is false (a restore fills it)."""
    model, loss_fn, init_state = _components(spec, total_steps or spec.train.steps)
    step = wrap(loss_step(loss_fn), spec, mesh)
    abstract = abstract_state(step, init_state, jax.random.key(spec.seed))
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    job = Job(spec, model, step, data, abstract, init_state)
    if init:
        job.init_state()
    return job


def reference_job(spec: Spec, total_steps: int, run_dir: Path,
                  initial: dict[str, np.ndarray] | None = None):
    """The reference job as the run loop takes it: (JaxEngine, abstract state, init, data), on
    the largest mesh the spec allows; this process's rows of each batch. `init` starts from
    `initial` (by path) when given, else from the seeded draws, and writes the parameters it
    starts from to RUN_DIR/initial_params.safetensors (a run that resumes does not call it)."""
    job = build_job(spec, largest_mesh(spec), total_steps=total_steps, init=False)
    rows = local_rows(job.step)
    check_host_batch(job.data.host_bytes(rows.stop - rows.start))  # before it takes the memory
    held_out = evaluation.reference_batches(spec) if spec.eval.interval else None
    step = JaxEngine(job.step, model_flops(spec), make_schedule(spec, total_steps),
                   held_out and (lambda index: held_out.batch(index, rows)))

    def init():
        state = job.init_state(initial)
        save_initial(whole_arrays(state.params), run_dir, spec.model)
        return state

    return step, job.abstract_state, init, lambda index: job.data.batch(index, rows)


def user_job(spec: Spec, model: UserModel):
    """A user's model and data (`trainspec train --model`) as the run loop takes them, its
    loss wrapped as `loss_step`, on the largest mesh the spec allows."""
    step = wrap(loss_step(model.loss), spec, largest_mesh(spec))
    rng = jax.random.key(spec.seed)
    rows = local_rows(step)
    return (JaxEngine(step, model.model_flops(spec), model.schedule, model.eval_rows(rows)),
            abstract_state(step, model.init, rng), lambda: step.init(model.init, rng),
            model.train_rows(rows))


def run(
    spec: Spec,
    run_dir: Path,
    steps: int | None = None,
    spec_label: str = "default",
    progress: bool = True,
    summary_json: Path | None = None,
    faults: Faults | None = None,
    restart: bool = False,
    announce=None,
    model: UserModel | None = None,
    init_from: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Train to step `steps` (default `train.steps`), resuming from the newest good checkpoint
    in `run_dir` (or from step 0 with `restart`, the old checkpoints set aside); write metrics
    JSONL and checkpoints; return the summary.

    Saves `spec` as RUN_DIR/spec.toml (`trainspec train` reuses it when given no --spec);
    `announce(line)` is told where a resume starts. `faults` is the test hook
    (trainspec.core.faults): nothing is injected unless a test passes one.

    Raises HealthHalt when a guard stops the run, Preempted after SIGTERM/SIGINT (with the
    checkpoint written), UserInputError when the checkpoints are all bad or another framework's
    or a save fails, AlreadyTrained (having changed nothing) when the run is already at or past
    `steps`. Under `health.fingerprints.policy = "rollback"` diverged replicas are excluded and
    the run goes on from the last checkpoint on the devices left. `model`: train a user's
    model and data (`trainspec train --model`) instead of the reference job. `init_from`: the
    reference model's parameters to start from (trainspec.core.params_file.read) when the run
    does not resume; refused with `model` (UserInputError), as `trainspec train` refuses it."""
    JAX.check_flags({"--init-from": init_from, "--model": model})
    if model is not None and (model.tensor_plan is not None or model.fsdp_units is not None):
        raise UserInputError("--model: tensor_plan and fsdp_units name torch modules; on JAX "
                             "the spec's layout.rules split a model by its logical axis names")
    run_dir.mkdir(parents=True, exist_ok=True)
    faults = faults or Faults()

    def job(spec: Spec):
        t0 = time.perf_counter()
        built = (reference_job(spec, loop.total_steps, run_dir, init_from) if model is None
                 else user_job(spec, model))
        loop.goodput.add("initialization", time.perf_counter() - t0)
        return built

    loop = Run(spec, run_dir, Checkpointer(spec, run_dir), steps or spec.train.steps,
               restart=restart, progress=progress, announce=announce, faults=faults,
               spec_label=spec_label,
               rebuild=lambda devices: job(exclude(loop.step.spec, devices)))

    def build(loop: Run):
        checked, loop.summary_fields["preflight"] = preflight(  # health.preflight
            spec, loop.goodput, faulty_reduction(faults))
        return job(checked)

    summary = train(loop, build)
    if summary_json is not None and is_writer():
        write_json_atomically(Path(summary_json), summary)
    return summary
