"""`trainspec train --framework torch`: the default job in the run loop of every implementation
(trainspec.core.loop), on the torch implementation.

The same spec, data order (ByteBatches, rows by batch shard), checkpoint cadence, metrics
records (trainspec/core/metrics.schema.json), progress bar and summary keys as the JAX job
(trainspec/jax/train.py); one rank per device, rank 0 writes the job's files. PyTorch runs
eagerly, so the non-finite guard (the core's state machine) is applied per step.

The reference job's step (`TorchStep`) is the reference Transformer
(trainspec/torch/models/transformer.py) through the same wrapped step as a user's model
(trainspec/torch/step.py). Its FSDP2 units are
the blocks; its tensor-parallel plan is the default one (query/key/value and mlp_in
column-split, out and mlp_out row-split, the vocabulary head column-split with its output
gathered; the embedding table stays replicated). The model casts its matmul operands to
`precision.compute` itself, so no autocast.
"""
from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainspec.core import evaluation
from trainspec.core.data import ByteBatches
from trainspec.core.faults import Faults
from trainspec.core.health import HealthHalt
from trainspec.core.loop import train
from trainspec.core.run import Run
from trainspec.core.run_files import write_json_atomically
from trainspec.core.spec import Spec
from trainspec.core.transformer_flops import for_spec
from trainspec.core.user_model import UserModel
from trainspec.torch.runtime import TORCH_DTYPES as DTYPES, TorchRuntime
from trainspec.torch.capabilities import TORCH
from trainspec.torch.members import exclude_at_start, leave_out
from trainspec.torch.preflight import preflight
from trainspec.torch.params_file import save_initial, state_dict
from trainspec.torch.engine import TorchEngine
from trainspec.torch.run import TorchRunCheckpointer
from trainspec.torch.context import causal_attention
from trainspec.torch.models.transformer import Transformer, flax_path, next_token_loss
from trainspec.torch.support import check_run, check_spec
from trainspec.torch.pipeline import PipelineIO
from trainspec.torch.step import WrappedStep


def reference_loss(model: Transformer, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return next_token_loss(model(batch["inputs"]), batch["targets"], batch["mask"])


# The reference model through a pipeline: the last stage's target is the rows' targets and
# mask side by side, in float64 (token ids and mask values exactly), cut into micro-batches
# with the inputs.
REFERENCE_PIPELINE = PipelineIO(
    inputs=lambda batch: batch["inputs"],
    target=lambda batch: torch.stack([batch["targets"].double(), batch["mask"].double()], -1),
    loss=lambda logits, target: next_token_loss(logits, target[..., 0], target[..., 1])[0],
    tokens=lambda batch: batch["mask"].float().sum())


class TorchStep(WrappedStep):
    """Model, optimizer and the step of one rank. `__call__(rows)` takes this rank's rows of the
    global batch (`rows()` says which) and returns the step's global metrics; `apply(finite)`
    decides whether the update is taken (default: when finite)."""

    def __init__(self, spec: Spec, mesh: DeviceMesh, total_steps: int, device: torch.device,
                 initial_params: dict | None = None):
        check_spec(spec, mesh.size())
        p = spec.precision

        def build(attention=causal_attention) -> Transformer:
            model = Transformer(spec.model, DTYPES[p.compute], DTYPES[p.param], attention)
            if initial_params is None:
                model.init_weights(spec.seed)
            else:  # e.g. a JAX run's initial parameters, through NumPy (model.from_flax)
                model.load_state_dict(initial_params)
            return model

        # With a tensor axis too, the root's output is the head's DTensor.to_local(), a view,
        # and FSDP2 warns (on every rank) that an in-place op on it would skip its backward
        # hook. The loss reads the logits out of place only, so the warning says nothing here.
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r"FSDP2-wrapped module \(FSDPTransformer\) returned a view")
        super().__init__(build, reference_loss, spec, mesh=mesh, device=device,
                         total_steps=total_steps, fsdp_units=("blocks.*",), autocast=False,
                         nan_guard=False, pipeline_io=REFERENCE_PIPELINE)

    @staticmethod
    def packing_order(named: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The data all-reduce's buffer in the JAX step's order: parameters by their flax path
        (sorted, as jax flattens the tree), kernels in the flax layout (in, out), i.e. the
        nn.Linear weights transposed. A compressed reduction then cuts the same int8 blocks
        and chunks as JAX's when the local blocks are whole parameters (the data layout)."""
        ordered = sorted(named, key=lambda pair: flax_path(pair[0]))
        return [block.t() if name.endswith("weight") else block for name, block in ordered]

    def __call__(self, rows: dict[str, np.ndarray],
                 apply: Callable[[bool], bool] = bool) -> dict[str, float]:
        return super().__call__(rows, apply=apply)


def reference_job(spec: Spec, adapter: TorchRuntime, total_steps: int, run_dir: Path,
                  initial: dict[str, np.ndarray] | None = None):
    """The reference job as the run loop takes it: (TorchEngine, the step as restore target,
    init, this rank's rows of each batch). The model starts from `initial` (by path) when
    given, else from the seeded draws; `init`, called only when the run does not resume,
    writes those parameters to RUN_DIR/initial_params.safetensors."""
    job = TorchStep(spec, adapter.build_mesh(spec), total_steps, adapter.device,
                    None if initial is None else state_dict(initial, spec.model))
    data, rows = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed), job.rows()

    def init() -> TorchStep:
        save_initial(job.model, run_dir, spec.model, job.stage_group)
        return job

    held_out = evaluation.reference_batches(spec) if spec.eval.interval else None
    return (TorchEngine(job, adapter, for_spec(spec),
                         held_out and (lambda index: held_out.batch(index, rows))), job, init,
            lambda index: data.batch(index, rows))


def user_job(spec: Spec, model: UserModel, adapter: TorchRuntime, total_steps: int):
    """A user's model and data (`trainspec train --framework torch --model`) as the run loop
    takes them: `trainspec.torch.wrap` of its model and loss, this rank's rows of each batch."""
    job = WrappedStep(model.init, model.loss, spec, mesh=adapter.build_mesh(spec),
                      device=adapter.device, optimizer_fn=model.optimizer,
                      total_steps=total_steps, spec_schedule=model.optimizer is None,
                      tensor_plan=model.tensor_plan, fsdp_units=model.fsdp_units)
    rows = job.rows()
    return (TorchEngine(job, adapter, model.model_flops(spec), model.eval_rows(rows)), job,
            lambda: job,
            model.train_rows(rows))


def run(spec: Spec, run_dir: Path, steps: int | None = None, spec_label: str = "default",
        progress: bool = True, summary_json: Path | None = None,
        adapter: TorchRuntime | None = None, announce=None, restart: bool = False,
        faults: Faults | None = None, model: UserModel | None = None,
        init_from: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """One rank of the job: train to step `steps`, resuming from the newest checkpoint (or,
    with `restart`, from step 0, the old checkpoints set aside); saves `spec` as
    RUN_DIR/spec.toml, tells `announce(line)` where a resume starts. AlreadyTrained when the
    run dir is at or past `steps` (nothing changed); HealthHalt, Preempted as the JAX job;
    LeftOut on a rank `mesh.exclude_devices` or a rollback leaves out (trainspec.torch.members).
    `model`: train a user's model and data instead of the reference job; `init_from`: the
    reference model's parameters to start from (trainspec.core.params_file.read) when the run
    does not resume; refused with `model` (UserInputError), as `trainspec train` refuses it."""
    TORCH.check_flags({"--init-from": init_from, "--model": model})
    adapter = adapter or TorchRuntime(spec.collectives.timeout_s)
    owns_job = not dist.is_initialized()  # a caller that joined the job also leaves it
    adapter.join()
    try:
        # In a function of its own: the run's objects (the step, its mesh and groups) form
        # reference cycles, garbage once it returns, so that leave() can free them.
        return _run(spec, run_dir, steps, spec_label, progress, summary_json, adapter, announce,
                    restart, faults, model, init_from)
    except BaseException as err:  # its traceback's frames would keep the run's objects alive
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        if owns_job:
            adapter.leave()


def _run(spec, run_dir, steps, spec_label, progress, summary_json, adapter, announce, restart,
         faults, model, init_from) -> dict[str, Any]:
    """`run` on the joined job."""
    spec = exclude_at_start(adapter, spec)  # LeftOut on the ranks it names
    # every field, whoever started the ranks (a user's model: all but the reference model's)
    check_run(spec, adapter.process_count, own_model=model is not None)
    checkpoints = TorchRunCheckpointer(spec, run_dir, adapter.is_writer())
    loop = Run(spec, run_dir, checkpoints, steps or spec.train.steps, restart=restart,
               progress=progress, announce=announce, faults=faults, spec_label=spec_label,
               rebuild=lambda ranks: build(without(ranks)))

    def build(job_spec: Spec):
        t0 = time.perf_counter()
        built = (reference_job(job_spec, adapter, loop.total_steps, run_dir, init_from)
                 if model is None
                 else user_job(job_spec, model, adapter, loop.total_steps))
        loop.goodput.add("initialization", time.perf_counter() - t0)
        return built

    def without(ranks: list[int]) -> Spec:
        """The job re-formed without the diverged `ranks` (of the job as launched; a
        rollback, then the loop restores the last good checkpoint onto it); LeftOut on
        them."""
        checkpoints.wait()  # the last save and the step's stop vote use the groups
        loop.step.finish(None)  # about to go
        smaller = leave_out(adapter, loop.step.spec, ranks, "its replica diverged")
        checkpoints.rejoined(adapter.is_writer())
        return smaller

    def first_build(loop: Run):
        checked, loop.summary_fields["preflight"] = preflight(  # health.preflight
            adapter, spec, loop.goodput, faults and faults.faulty_reduction)
        checkpoints.rejoined(adapter.is_writer())  # the job may have lost its rank 0
        return build(checked)

    try:
        summary = train(loop, first_build)
    except HealthHalt:  # every rank halts after the same step: the stop vote it started
        loop.step.finish(None)  # completes before the groups go
        raise
    if summary_json is not None and adapter.is_writer():
        write_json_atomically(Path(summary_json), summary)
    return summary
