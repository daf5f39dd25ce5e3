"""`trainspec sweep`: a grid of small reference-model runs for scaling fits (docs/advice.md §3).

Each grid point is an ordinary run directory (`trainspec train` could resume it) plus
`scaling.json`: non-embedding parameters N, tokens trained D, model FLOPs C, and the loss on
held-out windows of the corpus (drawn with another seed than training's), which a scaling fit
needs rather than one noisy training batch.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np

from trainspec.jax.checkpoint import Checkpointer
from trainspec.core.data import ByteBatches
from trainspec.core.errors import UserInputError
from trainspec.core.transformer_flops import for_spec as model_flops
from trainspec.jax.models.transformer import next_token_loss
from trainspec.jax.pipeline_params import whole_arrays
from trainspec.core.scaling import RESULT  # what `trainspec scaling` reads
from trainspec.core.spec import Spec, load_spec
from trainspec.jax.train import build_job, run as train

HEAD_DIM = 16  # heads = d_model / 16 (at least one): width changes keep the head size
HELD_OUT_SEED = 1_000_003  # eval windows: a seed training never uses


def grid_spec(base: Spec, width: int, depth: int, tokens: int) -> tuple[Spec, int]:
    """(spec of one grid point, its steps): d_ff = 4 d_model, steps = ceil(tokens / batch)."""
    heads = max(1, width // HEAD_DIM)
    if width % heads:
        raise UserInputError(f"--widths: {width} is not a multiple of the head size {HEAD_DIM}")
    steps = math.ceil(tokens / (base.batch.global_batch * base.batch.seq_len))
    spec = load_spec(base, [f"model.d_model={width}", f"model.d_ff={4 * width}",
                            f"model.n_layers={depth}", f"model.n_heads={heads}",
                            f"train.steps={steps}", f"checkpoint.interval={steps}",
                            f"optimizer.warmup_steps={max(1, steps // 10)}"])
    return spec, steps


def held_out_loss(spec: Spec, run_dir: Path, batches: int) -> float:
    """Mean per-token loss of the run's last checkpoint on `batches` held-out batches."""
    job = build_job(spec, init=False)
    with Checkpointer(spec, run_dir) as ckpt:
        state, _ = ckpt.restore_latest(job.abstract_state)
    if state is None:
        raise UserInputError(f"{run_dir}: no checkpoint to evaluate")
    data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, HELD_OUT_SEED)

    def loss_sums(params, batch):
        logits = job.model.apply({"params": params}, batch["inputs"])
        return next_token_loss(logits, batch["targets"], batch["mask"])

    with job.step.context():
        fn = jax.jit(loss_sums)
        params = whole_arrays(state.params)  # the model's own tree under a pipeline too
        sums = [jax.device_get(fn(params, job.step.shard_batch(data.batch(i))))
                for i in range(batches)]
    return float(np.sum([s for s, _ in sums]) / np.sum([t for _, t in sums]))


def run_point(spec: Spec, steps: int, run_dir: Path, eval_batches: int) -> dict:
    summary = train(spec, run_dir, steps=steps, progress=False)
    flops = model_flops(spec)
    tokens = steps * spec.batch.global_batch * spec.batch.seq_len
    result = {
        "params": flops.non_embedding_params,
        "tokens": tokens,
        "compute": flops.model_per_token(spec.metrics.flops_convention) * tokens,
        "loss": held_out_loss(spec, run_dir, eval_batches),
        "train_loss": summary["final_loss"],
        "gns": summary.get("gns"),
        "model": spec.model.model_dump(),
        "steps": steps,
    }
    (run_dir / RESULT).write_text(json.dumps(result, indent=2) + "\n")
    return result


def sweep(base: Spec, out: Path, widths, depths, token_budgets, eval_batches: int = 4,
          report=print) -> list[dict]:
    """Run every (width, depth, tokens) point into out/w{W}_l{L}_t{T}; returns the results."""
    for name, values in (("--widths", widths), ("--depths", depths), ("--tokens", token_budgets)):
        if not values or any(v < 1 for v in values):
            raise UserInputError(f"{name}: expected positive integers, got {list(values)}")
    points = [(w, d, t) for w in widths for d in depths for t in token_budgets]
    specs = [grid_spec(base, *p) for p in points]  # every bad point fails before any runs
    results = []
    for (w, d, t), (spec, steps) in zip(points, specs):
        run_dir = Path(out) / f"w{w}_l{d}_t{t}"
        result = run_point(spec, steps, run_dir, eval_batches)
        report(f"{run_dir}: N={result['params']} D={result['tokens']} "
               f"C={result['compute']:.3g} loss={result['loss']:.4f}")
        results.append(result)
    return results
