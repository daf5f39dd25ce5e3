"""A third implementation of trainspec, outside the two frameworks: NumPy, one process, the
data axis only (docs/adapters.md, "A third implementation"). What such an implementation
writes: an Adapter subclass (trainspec/core/adapter.py) with its capability table
(trainspec/core/capabilities.py), on the framework-free core.

Its 8 devices are simulated in one process (trainspec/core/simulated.py: a collective is the
core's float64 reference, rounded to the dtype); a step computes each data replica's gradient
sums of the reference transformer in float32 (trainspec/core/reference_model.py), adds them
as the all-reduce over `data` would, divides once by the batch's valid tokens and applies the
optimizer (trainspec/core/reference_train.py). With this directory on PYTHONPATH,
`trainspec conformance --impl numpy_impl:NumpyAdapter` runs the suite against it.
"""
from __future__ import annotations

import time

import numpy as np

from trainspec.core import bad_steps, flops, records, reference_train as train
from trainspec.core.capabilities import (
    Capabilities, Refusal, honoured, pipeline_fields_unused, refused, refused_section)
from trainspec.core.data import ByteBatches
from trainspec.core.goodput import Goodput
from trainspec.core.health import check_nan_guard, init_nan_guard, nan_guard_step
from trainspec.core.mesh import resolve_mesh
from trainspec.core.reference_model import loss_and_grad
from trainspec.core.simulated import SimulatedDevices
from trainspec.core.transformer_flops import TransformerFlops

def _unless(default, reason: str):
    shown = ("when true" if default is False else "unless empty" if default in ([], {})
             else f"unless {default}")
    return refused(shown, lambda value: value != default, reason)


NUMPY = Capabilities("numpy", {
    **{field: honoured() for field in (
        "spec_version", "seed", "mesh.axes.*.role", "batch.global_batch", "batch.micro_batch",
        "batch.seq_len", "collectives.timeout_s", "metrics.sink", "metrics.path",
        "metrics.interval", "metrics.flops_convention", "metrics.peak_flops_per_device",
        "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.d_ff",
        "optimizer.name", "optimizer.learning_rate", "optimizer.warmup_steps",
        "optimizer.weight_decay", "optimizer.grad_clip_norm", "train.steps",
        "health.nan.max_consecutive_skips")},
    "health.nan.policy": honoured("skip, halt: the core's state machine; rollback: a bad step "
                                  "halts (no checkpoint to roll back to)"),
    **{f"health.nan.{name}": honoured("no effect without checkpoints (refused)")
       for name in ("max_rollbacks", "skip_batches")},
    **{f"health.spikes.{name}": honoured("the core's rule, per step")
       for name in ("window", "k", "min_excess", "min_steps")},
    "mesh.axes.*.size": honoured("8 simulated devices", Refusal(
        "when a non-data axis is split",
        lambda value, r: bool(r.dims.split_beside("data")),
        "the numpy implementation splits data axes only")),
    "mesh.axes.*.dcn": refused("unless 1", lambda dcn: set(dcn) != {1}, "one process"),
    "mesh.exclude_devices": _unless([], "its devices are simulated"),
    "layout.rules": _unless({}, "the data axis only: no layout"),
    "layout.optimizer_state": _unless("like_params", "the data axis only: no layout"),
    **{f"precision.{name}": _unless("float32", "float32 only")
       for name in ("param", "compute", "grad_reduce")},
    "remat.policy": _unless("none", "it keeps every activation"),
    **pipeline_fields_unused(),
    "collectives.backend": _unless("xla", "its own collectives only"),
    "collectives.compression": _unless("none", "float32 gradients only"),
    "collectives.error_feedback": honoured("no effect without a compression (refused)"),
    "collectives.compression_block": honoured("no effect without a compression (refused)"),
    "metrics.tensorboard": _unless(False, "metrics.jsonl only"),
    "metrics.sinks": _unless([], "metrics.jsonl only"),
    "metrics.gns": honoured("absent: not measured, the summary says so", Refusal(
        "when true", lambda gns, r: bool(gns), "the numpy implementation does not measure it")),
    "checkpoint.interval": _unless(0, "no checkpoints"),
    "eval.interval": _unless(0, "no held-out evaluation"),
    **{f"eval.{name}": honoured("no effect without evaluation (refused)")
       for name in ("batches", "source")},
    "profile.start_step": _unless(0, "no profiler"),
    **{f"profile.{name}": honoured("no effect without a profiler (refused)")
       for name in ("steps", "process")},
    **{f"checkpoint.{name}": honoured("no effect without checkpoints (refused)")
       for name in ("keep", "async_save", "dir")},
    "health.preflight": _unless(False, "its devices are simulated"),
    "health.fingerprints.interval": _unless(0, "one copy of the state"),
    "health.fingerprints.policy": honoured("no effect without fingerprints (refused)"),
    **{f"health.stragglers.{name}": honoured("one process: no participant lags another")
       for name in ("window", "k", "min_excess")},
    "semi_sync": refused_section("synchronous training only"),
    "model.moe": refused_section("a dense model only"),
    **{f"context.{name}": honoured("no effect: data axes only")
       for name in ("attention", "split")},
})


class NumpyAdapter(SimulatedDevices):
    """8 devices simulated in this process (trainspec/core/simulated.py: collectives through
    the core's float64 reference); the reference job's steps in float32 NumPy."""

    name = "numpy"
    capabilities = NUMPY
    trainer = train.Trainer  # the reference's optimizer steps, run in float32

    def build_mesh(self, spec):
        return resolve_mesh(spec, self.devices)

    # -- the reference job ----------------------------------------------------------------
    def gradient(self, spec, params, batch) -> tuple[float, float, dict]:
        """Each data replica's rows, micro-batch by micro-batch: the summed loss, valid tokens
        and gradient sums, added over replicas and micro-batches (float32)."""
        dims = resolve_mesh(spec, self.devices)
        if dims.split_beside("data"):
            raise NotImplementedError(f"the numpy implementation splits data axes only, got "
                                      f"{dims.describe()}")
        replicas = dims.replicas
        k = spec.batch.accumulation_steps
        total = [np.float32(0), np.float32(0), None]
        for rows in np.array_split(np.arange(spec.batch.global_batch), replicas):
            for j in range(k):
                micro = {key: v[rows][j::k] for key, v in batch.items()}
                loss, tokens, grads = loss_and_grad(params, micro, np.float32)
                total = [total[0] + np.float32(loss), total[1] + np.float32(tokens),
                         grads if total[2] is None else train.tree_map(np.add, total[2], grads)]
        return tuple(total)

    def step(self, trainer, batch, guard):
        loss_sum, tokens, grads = self.gradient(trainer.spec, trainer.params, batch)
        denom = np.float32(max(tokens, 1.0))
        grads = train.tree_map(lambda g: g / denom, grads)
        finite = np.isfinite(loss_sum) and np.isfinite(train.global_norm(grads))
        guard, take = nan_guard_step(trainer.spec.health.nan, guard, np.bool_(finite))
        norm = trainer.apply(grads) if take else train.global_norm(grads)
        return float(loss_sum / denom), norm, float(tokens), guard

    def train_steps(self, spec, params, batches):
        trainer, guard, steps = self.trainer(spec, params, np.float32), init_nan_guard(), []
        for batch in batches:
            loss, norm, _, guard = self.step(trainer, batch, guard)
            steps.append((loss, norm, train.tree_map(np.copy, trainer.params)))
        return steps

    def train_run(self, spec, run_dir, steps):
        """`trainspec train` in brief: a record every metrics.interval steps, a summary."""
        trainer = self.trainer(spec, train.initial_params(spec.model, spec.seed), np.float32)
        data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
        tokens_per_step = flops.tokens_per_step(spec)
        model = TransformerFlops(spec.model, spec.batch.seq_len)
        peak = flops.peak_flops(spec, "cpu")
        facts = {"model_flops_per_step": model.model_per_token(spec.metrics.flops_convention)
                 * tokens_per_step, "flops_convention": spec.metrics.flops_convention,
                 "peak_flops_per_device": peak.flops_per_device, "peak_flops_source": peak.source,
                 "n_devices": self.devices, "batch_tokens": tokens_per_step,
                 "hardware_flops_per_step": None, "comm_bytes_by_kind": {},
                 "comm_bytes_by_axis": {}}
        sink, guard, goodput = self.open_metrics(run_dir / spec.metrics.path), init_nan_guard(), \
            Goodput()
        pending, tokens, start = 0, 0.0, time.perf_counter()
        spikes = bad_steps.LossSpikes(spec.health.spikes)
        for step in range(1, steps + 1):
            lr = train.learning_rate(spec.optimizer, spec.train.steps, trainer.count)
            loss, norm, valid, guard = self.step(trainer, data.batch(step - 1), guard)
            if spec.health.nan.policy == "rollback":  # without checkpoints a bad step halts
                reason = bad_steps.verdict(step, np.isfinite(norm), loss, spikes)
                if reason is not None:
                    raise bad_steps.halt_line(spec.health.nan, reason, 0, None, run_dir)
            pending, tokens = pending + 1, tokens + valid
            if step % spec.metrics.interval and step < steps:
                continue
            check_nan_guard(spec.health.nan, guard)
            wall = time.perf_counter() - start
            goodput.interval(pending, wall, 0.0)
            sink.write({**dict.fromkeys(records.REQUIRED),  # null: not measured here
                        "schema": records.SCHEMA_ID, "step": step, "steps_in_interval": pending,
                        "time": time.time(), "loss": loss, "grad_norm": norm, "learning_rate": lr,
                        **records.interval_fields(facts, pending, wall, tokens, tokens_per_step,
                                                  0.0, goodput.summary())})
            pending, tokens, start = 0, 0.0, time.perf_counter()
        sink.close()
        return {"final_loss": loss, "steps": steps, "gns": None,
                "gns_not_measured": "the numpy implementation does not measure it"}
