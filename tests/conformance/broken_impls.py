"""Implementations the conformance suite must fail (tests/conformance/test_suite_can_fail.py).

- `DoNothing`: collectives through the core's reference, a constant loss, parameters never
  changed, made-up metric records that validate against the schema. It passes every family
  that looks at the collectives alone.
- `WrongClip`: the numpy implementation clipping the gradient to twice the spec's norm (its
  reported gradient norm stays right).
- `NoDecay`, `DecayOneDimOnly`, `EarlyWarmup`: the numpy implementation ignoring
  `optimizer.weight_decay`, decaying only the 1-D parameters (the norm scales), and warming up
  one update early (update n at (n + 1) / warmup_steps of the rate, a common off-by-one).
- `Overclaiming`: declares fsdp and tensor axes honoured, then cannot split them.
- `Undeclared`: a capability table without an entry for `metrics.tensorboard`.
"""
from __future__ import annotations

import time

import numpy as np
from numpy_impl import NUMPY, NumpyAdapter

from trainspec.core import records, reference_train as train
from trainspec.core.capabilities import Capabilities, honoured
from trainspec.core.spec import load_spec


class DoNothing(NumpyAdapter):
    name = "do-nothing"

    def train_steps(self, spec, params, batches):
        return [(5.5, 1.0, train.tree_map(lambda p: p.copy(), params)) for _ in batches]

    def train_run(self, spec, run_dir, steps):
        sink = self.open_metrics(run_dir / spec.metrics.path)
        for step in range(1, steps + 1):
            record = {field: None for field in records.REQUIRED}
            record.update({
                "schema": records.SCHEMA_ID, "step": step, "steps_in_interval": 1,
                "time": time.time(), "learning_rate": 1e-3, "step_time_s": 0.1,
                "tokens_per_s": 1.0, "padded_tokens_per_s": 1.0, "model_flops_per_step": 1.0,
                "flops_convention": spec.metrics.flops_convention, "peak_flops_source": "made up",
                "n_devices": 8, "comm_bytes_by_kind": {}, "comm_bytes_by_axis": {},
                "data_wait_s": 0.0, "data_wait_fraction": 0.0, "elapsed_s": 0.1 * step,
                "badput_s": {}, "batch_tokens": 1})
            sink.write(record)
        sink.close()
        return {}


class WrongClip(NumpyAdapter):
    name = "wrong-clip"

    def train_steps(self, spec, params, batches):
        clip = spec.optimizer.grad_clip_norm
        return super().train_steps(load_spec(spec, [f"optimizer.grad_clip_norm={2 * clip}"]),
                                   params, batches)


class NoDecay(NumpyAdapter):
    name = "no-decay"

    def train_steps(self, spec, params, batches):
        return super().train_steps(load_spec(spec, ["optimizer.weight_decay=0"]), params, batches)


class _OneDimDecayTrainer(train.Trainer):
    def decayed(self, param):
        return param if param.ndim == 1 else np.zeros_like(param)


class DecayOneDimOnly(NumpyAdapter):
    name = "decay-1d-only"
    trainer = _OneDimDecayTrainer


class _EarlyWarmupTrainer(train.Trainer):
    def learning_rate(self):
        o = self.spec.optimizer
        warmup = min(o.warmup_steps, self.spec.train.steps - 1)
        if self.count < warmup:
            return o.learning_rate * (self.count + 1) / warmup
        return super().learning_rate()


class EarlyWarmup(NumpyAdapter):
    name = "early-warmup"
    trainer = _EarlyWarmupTrainer


class Overclaiming(NumpyAdapter):
    name = "overclaiming"
    capabilities = Capabilities("overclaiming", {
        **NUMPY.entries, "mesh.axes.*.size": honoured("any split, it says")})


class Undeclared(NumpyAdapter):
    name = "undeclared"
    capabilities = Capabilities("undeclared", {
        f: e for f, e in NUMPY.entries.items() if f != "metrics.tensorboard"})
