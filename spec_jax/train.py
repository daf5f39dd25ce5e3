"""The default training job: the reference transformer on the embedded corpus, under a spec.

`build_job` assembles model, optimizer, data and the wrapped step; `run` is the loop that
`trainspec train` calls. The loop syncs with the device only at the metrics interval.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from spec_jax.data import ByteBatches
from spec_jax.models.transformer import Transformer, next_token_loss
from spec_jax.spec import Spec
from spec_jax.step import WrappedStep, loss_step, wrap


def make_optimizer(spec: Spec, total_steps: int) -> optax.GradientTransformation:
    o = spec.optimizer
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, o.learning_rate, max(1, min(o.warmup_steps, total_steps - 1)), max(total_steps, 2),
        end_value=o.learning_rate * 0.1,
    )
    opt = (
        optax.adamw(schedule, weight_decay=o.weight_decay)
        if o.name == "adamw"
        else optax.sgd(schedule, momentum=0.9)
    )
    return optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), opt) if o.grad_clip_norm else opt


@dataclasses.dataclass
class Job:
    spec: Spec
    model: Transformer
    step: WrappedStep
    data: ByteBatches
    state: Any

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {name: int(size) for name, size in self.step.mesh.shape.items()}


def _components(spec: Spec, total_steps: int):
    model = Transformer(
        spec.model,
        dtype=jnp.dtype(spec.precision.compute),
        param_dtype=jnp.dtype(spec.precision.param),
        remat=spec.remat.policy,
    )

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        loss_sum, tokens = next_token_loss(logits, batch["targets"], batch["mask"])
        return loss_sum, tokens, {}

    tx = make_optimizer(spec, total_steps)

    def init_state(rng):
        tokens = jnp.zeros((1, spec.batch.seq_len), jnp.int32)
        params = model.init(rng, tokens)["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return model, loss_fn, init_state


def build_abstract_job(spec: Spec, mesh=None):
    """(wrapped step with its state shardings planned, abstract state): nothing is computed."""
    _, loss_fn, init_state = _components(spec, spec.train.steps)
    step = wrap(loss_step(loss_fn), spec, mesh)
    return step, step.plan(init_state, jax.random.key(spec.seed))


def build_job(spec: Spec, mesh=None, total_steps: int | None = None) -> Job:
    model, loss_fn, init_state = _components(spec, total_steps or spec.train.steps)
    step = wrap(loss_step(loss_fn), spec, mesh)
    state = step.init(init_state, jax.random.key(spec.seed))
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
    return Job(spec, model, step, data, state)


def local_rows(global_batch: int) -> slice:
    """This process's rows of the global batch (all of them in a single process)."""
    per_process = global_batch // jax.process_count()
    start = jax.process_index() * per_process
    return slice(start, start + per_process)


def _write_json_atomically(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees a half-written summary


def run(
    spec: Spec,
    run_dir: Path,
    steps: int | None = None,
    spec_label: str = "default",
    progress: bool = True,
    summary_json: Path | None = None,
) -> dict[str, Any]:
    """Train for `steps` (default `train.steps`); write metrics JSONL; return the summary."""
    steps = steps or spec.train.steps
    run_dir.mkdir(parents=True, exist_ok=True)
    job = build_job(spec, total_steps=steps)
    interval = spec.metrics.interval
    rows = local_rows(spec.batch.global_batch)
    tokens_per_step = spec.batch.global_batch * spec.batch.seq_len

    bar = _progress_bar(steps, progress)
    metrics_path = run_dir / spec.metrics.path
    losses: dict[int, float] = {}
    timed_steps, timed_seconds = 0, 0.0
    state = job.state
    with open(metrics_path, "w") as sink:
        t_last, pending = None, 0
        for step in range(1, steps + 1):
            state, metrics = job.step(state, job.data.batch(step - 1, rows))
            pending += 1
            if step == 1 or step % interval == 0 or step == steps:
                loss = float(metrics["loss"])  # the only host sync: once per interval
                now = time.perf_counter()
                losses[step] = loss
                record = {"step": step, "loss": loss}
                if t_last is not None:  # step 1 includes compilation: not a step time
                    dt = (now - t_last) / pending
                    timed_steps += pending
                    timed_seconds += now - t_last
                    record |= {"step_time_s": dt, "tokens_per_s": tokens_per_step / dt}
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                t_last, pending = now, 0
                bar.update(step - bar.n)
                bar.set_postfix(
                    loss=f"{loss:.3f}",
                    tok_s=f"{record.get('tokens_per_s', 0):.0f}",
                )
    bar.close()
    jax.block_until_ready(state)
    step_time = timed_seconds / timed_steps if timed_steps else float("nan")
    summary = {
        "initial_loss": losses[1],
        "final_loss": losses[steps],
        "tokens_per_s": tokens_per_step / step_time if timed_steps else float("nan"),
        "step_time_s": step_time,
        "steps": steps,
        "mesh": job.mesh_shape,
        "accumulation_steps": spec.batch.accumulation_steps,
        "spec": spec_label,
        "metrics_file": str(metrics_path),
    }
    if summary_json is not None:
        _write_json_atomically(Path(summary_json), summary)
    return summary


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)

