"""`trainspec train --framework torch`: the default job's loop on the torch implementation.

The same spec, data order (ByteBatches, rows by batch shard), checkpoint cadence, metrics
records (trainspec/core/metrics.schema.json), progress bar and summary keys as the JAX loop
(trainspec/jax/train.py); one rank per device, rank 0 writes the job's files. PyTorch runs eagerly,
so the loop knows each step's loss when the step returns: the non-finite guard (the core's
state machine) is applied per step, and nothing is compiled (`compile_time_s` is null).
"""
from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainspec.torch.adapter import TorchAdapter
from trainspec.torch.checkpoint import TorchCheckpointer
from trainspec.torch.step import TorchStep, learning_rate, local_block
from trainspec.torch.support import check_run
from trainspec.core import flops, records
from trainspec.core.gns import NoiseScale, record_fields
from trainspec.core.goodput import Goodput
from trainspec.core.health import (
    HealthHalt, ReplicaMismatch, StragglerDetector, check_nan_guard, init_nan_guard, nan_guard_step,
    odd_copies)
from trainspec.core.spec import Spec
from trainspec.core.data import ByteBatches
from trainspec.core.transformer_flops import TransformerFlops
from trainspec.core.run_files import (
    AlreadyTrained, resume_line, resume_mark, save_spec, write_json_atomically)

# Record fields that PyTorch's eager execution does not measure (no compiled program to
# analyse): null, as the record format prescribes for an unknown value.
NOT_MEASURED = ("xla_flops_per_step", "hardware_flops_per_step", "hfu", "compile_time_s",
                "memory_peak_bytes", "memory_argument_bytes", "memory_output_bytes",
                "memory_alias_bytes", "memory_temp_bytes", "memory_generated_code_bytes",
                "memory_xla_peak_bytes", "memory_live_bytes", "comm_bytes_per_step",
                "comm_bus_bytes_per_step")
FAULTS_ENV = "TRAINSPEC_FAULTS"  # the JAX loop's fault-injection hook (trainspec/jax/health/faults.py)


class TorchSession:
    """One `trainspec train --framework torch` rank: resume, loop, checkpoint, record."""

    def __init__(self, spec: Spec, run_dir: Path, steps: int, adapter: TorchAdapter,
                 progress: bool, announce=None):
        self.goodput = Goodput()
        self.noise_scale = NoiseScale()  # the step's gns parts, estimated as the JAX logger does
        self.spec, self.steps, self.adapter = spec, steps, adapter
        self.writer = adapter.is_writer()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt = TorchCheckpointer(spec, run_dir, self.writer)
        self.total_steps = self.ckpt.saved_total_steps() or steps  # a resume keeps its schedule
        t0 = time.perf_counter()
        self.mesh = adapter.build_mesh(spec)
        self.job = TorchStep(spec, self.mesh, self.total_steps, adapter.device)
        t1 = time.perf_counter()
        meta = self.ckpt.restore_latest(self.job.model, self.job.optimizer)
        self.goodput.add("initialization", t1 - t0)
        self.goodput.add("checkpoint_restore" if meta else "initialization", time.perf_counter() - t1)
        self.step = self.start = meta["data_position"] if meta else 0
        if self.start >= steps:  # before anything is written
            raise AlreadyTrained(run_dir, self.start, steps)
        self.resume_mark = resume_mark(meta) if meta else None  # on the first record after it
        if meta and announce and self.writer:
            announce(resume_line(self.resume_mark, self.mesh_shape))
        self.job.updates = meta["updates"] if meta else 0
        self.skipped_before = meta["skipped_steps"] if meta else 0
        self.guard = init_nan_guard(self.step)
        self.faults = json.loads(os.environ.get(FAULTS_ENV, "{}"))
        self.data = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)
        self.rows = self.job.rows()
        self.metrics_path = run_dir / spec.metrics.path
        # Process 0 writes; a resumed run keeps the records up to its step (and their losses).
        self.sink = adapter.open_metrics(self.metrics_path, append=meta is not None)
        self.losses = self.sink.rewind(self.step) if self.sink else {}
        self.stragglers = StragglerDetector(
            spec.health.stragglers, [f"rank {r}" for r in range(adapter.process_count)])
        self.facts = self._static_fields()
        self.bar = _progress_bar(steps, progress and self.writer)
        self.bar.update(self.step)
        self.interval_start, self.pending, self.pending_wait, self.pending_tokens = None, 0, 0.0, 0.0
        self.times: list[tuple[int, float]] = []
        self.seconds, self.timed_steps, self.valid_tokens = 0.0, 0, 0.0

    def _static_fields(self) -> dict[str, Any]:
        spec = self.spec
        model = TransformerFlops(spec.model, spec.batch.seq_len, spec.remat.policy)
        kind = torch.cuda.get_device_name() if self.adapter.device_type == "cuda" else "cpu"
        local_ranks = int(dist.get_world_size()) if kind == "cpu" else 1  # ranks share the CPU
        peak = flops.peak_flops(spec, kind, local_ranks)
        convention = spec.metrics.flops_convention
        return {
            "model_flops_per_step": model.model_per_token(convention) * flops.tokens_per_step(spec),
            "flops_convention": convention,
            "peak_flops_per_device": peak.flops_per_device,
            "peak_flops_source": peak.source,
            "n_devices": self.adapter.process_count,
            "batch_tokens": flops.tokens_per_step(spec),
            **dict.fromkeys(NOT_MEASURED),
            "gns_source": self.job.gns_source,
            "comm_bytes_by_kind": {},
            "comm_bytes_by_axis": {},
        }

    # -- the loop ------------------------------------------------------------------------------
    def train(self) -> None:
        self.interval_start = time.perf_counter()
        try:
            while self.step < self.steps:
                self.step += 1
                t0 = time.perf_counter()
                batch = self._faulty(self.data.batch(self.step - 1, self.rows))
                waited = time.perf_counter() - t0
                metrics = self.job(batch, apply=self._take)
                self._flip_bit_if_asked()
                self.times.append((self.step, time.perf_counter() - t0))
                self._after_step(metrics, waited)
                if self._fingerprint_due() or self.ckpt.due(self.step, self.steps):
                    self._check_replicas()  # never checkpoint a diverged replica
                if self.ckpt.due(self.step, self.steps):  # after the record that marks it
                    t0 = time.perf_counter()
                    self._save(self.step)
                    self.goodput.add("checkpoint_save", time.perf_counter() - t0)
        except HealthHalt as halt:
            if not isinstance(halt, ReplicaMismatch):  # the guard kept the last good state
                self._save(halt.last_good_step)
            raise
        finally:
            self.bar.close()
            if self.sink:
                self.sink.close()

    def _faulty(self, batch: dict) -> dict:
        """Test hook, as the JAX loop's: a NaN mask at the steps TRAINSPEC_FAULTS names."""
        if self.step in self.faults.get("nan_steps", ()):
            return {**batch, "mask": np.full_like(batch["mask"], np.nan)}
        return batch

    def _flip_bit_if_asked(self) -> None:
        """Test hook: TRAINSPEC_FAULTS `bitflip` [step, rank] flips bit 20 of the first
        element of that rank's copy of the first parameter after that step (a silent data
        corruption for the fingerprint check to find)."""
        flip = self.faults.get("bitflip")
        if flip and flip == [self.step, self.adapter.process_index]:
            with torch.no_grad():
                first = local_block(self.job.params[0]).view(-1)[:1]
                first.view(torch.int32).bitwise_xor_(1 << 20)

    def _fingerprint_due(self) -> bool:
        n = self.spec.health.fingerprints.interval
        return n > 0 and self.step % n == 0

    def _check_replicas(self) -> None:
        """Fingerprint every parameter's local block; the copies across the data group must
        agree (the core's majority vote names the odd ones). torch cannot leave ranks out of
        a running job, so a mismatch halts under either policy (docs/adapters.md): a restart
        with the healthy ranks resumes from the last checkpoint."""
        group = self.job.data_group
        if group is None:
            return
        mine = [self.adapter.fingerprint(local_block(p.detach())) for p in self.job.params]
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        for i, (name, _) in enumerate(self.job.model.named_parameters()):
            odd = odd_copies([struct.pack("<II", *copies[i]) for copies in every])
            if odd:
                raise ReplicaMismatch(
                    f"replica fingerprints differ after step {self.step}: {name} on ranks "
                    f"{[ranks[j] for j in odd]} (health.fingerprints.policy = "
                    f"{self.spec.health.fingerprints.policy}; torch halts, a restart on the "
                    "healthy ranks resumes from the last checkpoint)",
                    self.ckpt.last_saved or 0, [ranks[j] for j in odd])

    def _take(self, finite: bool) -> bool:
        """The core's non-finite state machine: whether this step's update is applied."""
        self.guard, take = nan_guard_step(self.spec.health.nan, self.guard, np.bool_(finite))
        return bool(take)

    def _save(self, step: int) -> None:
        skipped = self.skipped_before + int(self.guard["skipped"])
        self.ckpt.save(step, self.job.model, self.job.optimizer, self.total_steps,
                       self.job.updates, skipped, self.mesh_shape)

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {name: int(self.mesh.size(i)) for i, name in enumerate(self.mesh.mesh_dim_names)}

    def _after_step(self, metrics: dict, waited: float) -> None:
        self.pending += 1
        self.pending_wait += waited
        self.pending_tokens += metrics["valid_tokens"]
        parts = (metrics.get("gns_grad_sq"), metrics.get("gns_trace"))
        if None not in parts and np.isfinite(parts).all():  # not on a skipped step
            self.noise_scale.update(*parts)
        checkpointing = self.ckpt.due(self.step, self.steps)
        if not (self.step == self.start + 1 or self.step % self.spec.metrics.interval == 0
                or self.step == self.steps or checkpointing):
            return
        check_nan_guard(self.spec.health.nan, self.guard)  # raises HealthHalt when tripped
        record = self._record(metrics, checkpointing)
        self.losses[self.step] = record["loss"] if record["loss"] is not None else float("nan")
        self.bar.update(self.step - self.bar.n)
        self.bar.set_postfix(loss=f"{self.losses[self.step]:.3f}",
                             tok_s=f"{record['tokens_per_s']:.0f}",
                             mfu=f"{100 * (record['mfu'] or 0):.1f}%")

    def _observe_stragglers(self) -> None:
        """Every rank's step times, gathered at the record (one collective per interval)."""
        local = torch.tensor([t for _, t in self.times], dtype=torch.float64)
        every = [torch.empty_like(local) for _ in range(self.adapter.process_count)]
        dist.all_gather(every, local)
        for i, (step, _) in enumerate(self.times):
            self.stragglers.observe(step, [float(t[i]) for t in every])
        self.times.clear()

    def _record(self, metrics: dict, checkpointing: bool) -> dict:
        self._observe_stragglers()
        now = time.perf_counter()
        wall, n = now - self.interval_start, self.pending
        self.seconds += wall
        self.timed_steps += n
        self.valid_tokens += self.pending_tokens
        self.goodput.interval(n, wall, self.pending_wait)
        record = {
            "schema": records.SCHEMA_ID, "step": self.step, "steps_in_interval": n,
            "time": time.time(),
            "loss": records.finite_or_none(metrics["loss"]),
            "grad_norm": records.finite_or_none(metrics["grad_norm"]),
            # the update count this step used: the applied updates less its own, if applied
            "learning_rate": learning_rate(self.spec.optimizer, self.total_steps,
                                           self.job.updates - (1 - metrics["nonfinite"])),
            **records.interval_fields(self.facts, n, wall, self.pending_tokens,
                                      flops.tokens_per_step(self.spec), self.pending_wait,
                                      self.goodput.summary(now)),
            "skipped_steps": self.skipped_before + int(self.guard["skipped"]),
            "stragglers": self.stragglers.stragglers(),
            **record_fields(self.noise_scale.estimate()),
            "framework": "torch",
            **(self.resume_mark or {}),
            **({"checkpoint_saved": True} if checkpointing else {}),
        }
        self.resume_mark = None
        if self.sink:
            self.sink.write(record)
        self.pending, self.pending_wait, self.pending_tokens = 0, 0.0, 0.0
        self.interval_start = time.perf_counter()  # writing the record is not step time
        return record

    def summary(self, spec_label: str) -> dict[str, Any]:
        return {
            **records.run_fields(self.facts, self.seconds, self.timed_steps, self.valid_tokens,
                                 self.goodput.summary(), self.losses, self.steps),
            **record_fields(self.noise_scale.estimate()),
            "gns_not_measured": self.job.gns_note,  # None when measured
            "steps": self.steps, "resumed_from": self.start,
            "last_checkpoint": self.ckpt.last_saved, "rollbacks": [], "excluded_devices": [],
            "skipped_steps": self.skipped_before + int(self.guard["skipped"]),
            **self.stragglers.report(),
            "mesh": self.mesh_shape,
            "accumulation_steps": self.spec.batch.accumulation_steps,
            "spec": spec_label, "metrics_file": str(self.metrics_path), "framework": "torch",
        }


def run(spec: Spec, run_dir: Path, steps: int | None = None, spec_label: str = "default",
        progress: bool = True, summary_json: Path | None = None,
        adapter: TorchAdapter | None = None, announce=None) -> dict[str, Any]:
    """One rank of the job: train to step `steps`, resuming from the newest checkpoint; saves
    `spec` as RUN_DIR/spec.toml, tells `announce(line)` where a resume starts. AlreadyTrained
    when the run dir is at or past `steps` (nothing changed)."""
    adapter = adapter or TorchAdapter(spec.collectives.timeout_s)
    owns_job = not dist.is_initialized()  # a caller that joined the job also leaves it
    adapter.join()
    try:
        check_run(spec, adapter.process_count)  # every field, whoever started the ranks
        session = TorchSession(spec, run_dir, steps or spec.train.steps, adapter, progress,
                               announce)
        if session.writer:
            save_spec(spec, run_dir)
        session.train()
        summary = session.summary(spec_label)
        if summary_json is not None and session.writer:
            write_json_atomically(Path(summary_json), summary)
        return summary
    finally:
        if owns_job:
            adapter.leave()


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="train[torch]", unit="step", disable=not enabled,
                dynamic_ncols=True)
