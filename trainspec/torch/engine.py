"""The torch backend's engine (trainspec.core.backend.Engine): a wrapped step of one rank
(trainspec.torch.step) as the run loop drives it. The step reads nothing on the host: its
metrics stay tensors until a record reads them (`to_host`), and the non-finite guard, the
core's state machine (trainspec.core.health), decides each step on the device
(trainspec.torch.guard). Nothing is compiled (`compile_time_s` is null). The decisions around
it are the trunk's (trainspec.core.run).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainspec.core import flops
from trainspec.core.health import check_nan_guard
from trainspec.core.semi_sync import combine_groups, stack_groups
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.comm import BUS_FACTOR, CommCounter, mesh_axes_of
from trainspec.torch.guard import DeviceGuard
from trainspec.torch.layout import local_block
from trainspec.torch.peak import peak_flops
from trainspec.torch.step import WrappedStep, to_host

# Record fields that PyTorch's eager execution does not measure (no compiled program to
# analyse): null, as the record format prescribes for an unknown value.
NOT_MEASURED = ("xla_flops_per_step", "hardware_flops_per_step", "hfu", "compile_time_s",
                "memory_peak_bytes", "memory_argument_bytes", "memory_output_bytes",
                "memory_alias_bytes", "memory_temp_bytes", "memory_generated_code_bytes",
                "memory_xla_peak_bytes", "memory_live_bytes")


class TorchEngine:
    """The engine (trainspec.core.backend.Engine) over a wrapped torch `step` of this rank; the
    state is the step itself; its metrics are tensors until `to_host`. `model_flops`: the
    model's analytic FLOPs (MFU is null without them)."""

    framework = "torch"
    local_signals = True  # every rank catches them; `stop_signal` agrees on one

    def __init__(self, step: WrappedStep, adapter: TorchRuntime,
                 model_flops: flops.ModelFlops | None = None, eval_data=None):
        self.job, self.adapter, self.model_flops = step, adapter, model_flops
        self.eval_data = eval_data  # eval batch i (this rank's rows): [eval]
        self.spec, self.mesh_shape = step.spec, step.mesh_shape
        self.gns_note = step.gns_note  # None when the step measures the noise scale
        self.process_index, self.is_writer = adapter.process_index, adapter.is_writer()
        self.participants = [f"rank {r}" for r in range(adapter.process_count)]
        self.guard = DeviceGuard(self.spec.health.nan, step.device)
        self._stop_vote = None  # the all-reduce of the last step's stop signals, in flight
        self._facts: dict | None = None  # the records' facts, until the first step counted
        self.semi_sync: dict | None = None  # the summary's semi_sync entry, once counted

    def evaluate(self, state, batch) -> tuple[float, float]:
        return state.evaluate(batch)

    # -- [profile] ------------------------------------------------------------------------
    def start_trace(self, directory: Path) -> None:
        """torch.profiler over CPU (and CUDA) activity, its Chrome trace written at the stop
        as DIR/rank<r>.trace.json (Perfetto and chrome://tracing open it)."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.adapter.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._trace = (torch.profiler.profile(activities=activities), directory)
        self._trace[0].__enter__()

    def stop_trace(self) -> None:
        profiler, directory = self._trace
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(str(directory / f"rank{self.process_index}.trace.json"))

    def __call__(self, state, batch):
        """The step; the first one after `facts` runs with its collectives counted, and the
        facts (the records' and summary's) gain the communication volume."""
        if self._facts is None:
            return state, state.device_step(batch, self.guard)
        with CommCounter() as counter:
            metrics = state.device_step(batch, self.guard)
        axes_of, outer = mesh_axes_of(state.mesh), state.outer
        if outer is None:
            self._facts.update(counter.volume(axes_of))
        else:  # amortised over the round, as the JAX records are (docs/metrics.md)
            h = outer.settings.inner_steps
            self._facts.update(counter.volume(axes_of, outer.exchange(), h))
            inner = counter.volume(axes_of, outer.exchange(), h=float("inf"))
            kind, size, ranks = outer.exchange()
            self.semi_sync = {"inner_steps": h, "groups": outer.groups,
                              "inner_comm_bytes_per_step": inner["comm_bytes_per_step"],
                              "outer_comm_bytes": size,
                              "outer_comm_bus_bytes": size * BUS_FACTOR[kind](len(ranks))}
        self._facts = None
        return state, metrics

    # -- records ---------------------------------------------------------------------------
    def facts(self, state, batch) -> dict[str, Any]:
        spec, tokens = self.spec, flops.tokens_per_step(self.spec)
        local_ranks = self.adapter.process_count if self.adapter.device_type == "cpu" else 1
        peak = peak_flops(spec, self.adapter.device_type, local_ranks)
        convention = spec.metrics.flops_convention
        model = self.model_flops
        self._facts = {
            "model_flops_per_step": model and model.model_per_token(convention) * tokens,
            "flops_convention": convention if model else None,
            "peak_flops_per_device": peak.flops_per_device,
            "peak_flops_source": peak.source,
            "n_devices": self.adapter.process_count,
            "batch_tokens": tokens,
            **dict.fromkeys(NOT_MEASURED),
            "gns_source": self.job.gns_source,
            # filled in by the first step (__call__), counted as it runs
            **dict.fromkeys(("comm_bytes_per_step", "comm_bus_bytes_per_step")),
            "comm_bytes_by_kind": {},
            "comm_bytes_by_axis": {},
        }
        return self._facts

    @staticmethod
    def per_record() -> dict:
        return {}

    # -- [semi_sync]: the groups' values, combined at records ----------------------------------
    def to_host(self, tree):
        """(metrics, tokens, noise-scale parts) of a record. Under [semi_sync] each group's own
        (nothing crossed the data axes in its steps): gathered over the data group here, at
        the record only; the metrics by group, the tokens summed over groups."""
        tree = to_host(tree)
        if self.job.outer is None:
            return tree
        every: list = [None] * self.job.outer.groups
        dist.all_gather_object(every, tree, group=self.job.data_group)
        metrics = stack_groups([m for m, _, _ in every])
        tokens = [sum(t) for t in zip(*(t for _, t, _ in every))]
        return metrics, tokens, every[0][2]

    def learning_rate(self, updates: int) -> float:
        """The step's: the spec's schedule over its run length (a resumed run keeps its own),
        or the optimizer's own learning rate where the model brings its optimizer."""
        return self.job.learning_rate(updates)

    def summary_fields(self) -> dict:
        """Under [semi_sync], the schedule and each part's bytes (as the JAX summary)."""
        return {"semi_sync": self.semi_sync} if self.semi_sync else {}

    # -- health ----------------------------------------------------------------------------
    def reset_guard(self, step: int, skipped: int, consecutive: int) -> None:
        self.guard = DeviceGuard(self.spec.health.nan, self.job.device, step, skipped,
                                 consecutive)
        if self.job.outer is not None:  # the outer schedule follows the data position
            self.job.outer.steps_done = step

    def check_nonfinite(self) -> int:
        """The steps skipped; HealthHalt when the guard tripped. Under [semi_sync] each group
        guards its own steps: every group's guard is read (at records and checkpoints), so
        that every rank halts when one group's guard tripped."""
        if self.job.outer is None:
            return self.guard.check()
        every: list = [None] * self.job.outer.groups
        dist.all_gather_object(every, to_host(self.guard.state), group=self.job.data_group)
        return max(check_nan_guard(self.spec.health.nan, guard) for guard in every)

    def nonfinite_counts(self) -> dict[str, int]:
        return self.guard.counts()

    def verdict_inputs(self, metrics: dict):
        """The step's host metrics (loss and gradient norm are global: every rank judges
        alike), asked for under `rollback` only (trainspec.core.run). Under [semi_sync] each group's are its own, so
        they are gathered over the data group and combined as a record's, or the groups
        would judge apart and one roll back alone."""
        if self.job.outer is None:
            return metrics
        every: list = [None] * self.job.outer.groups
        dist.all_gather_object(every, to_host(metrics), group=self.job.data_group)
        return combine_groups(stack_groups(every))

    @staticmethod
    def read_verdicts(inputs: list) -> list[tuple[bool, float]]:
        return [(math.isfinite(m["grad_norm"]), float(m["loss"])) for m in inputs]

    def state_is_finite(self, state) -> bool:
        """Every floating element of what this rank's checkpoints carry finite, on every rank:
        one all-reduce (max) of one integer."""
        bad = any(not bool(torch.isfinite(t).all())
                  for t in state.state_tensors() if t.is_floating_point())
        flag = torch.tensor([int(bad)], dtype=torch.int32)
        if len(self.participants) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not int(flag)

    def check_replicas(self, state, step: int, last_good_step: int | None) -> None:
        """The wrapped step's vote over the data axes' copies, the same on every rank, naming
        ranks of the job as launched: under `rollback` the run re-forms the job without them
        (trainspec.torch.train)."""
        state.check_replicas(step, last_good_step or 0, self.adapter.launched_ids)

    def corrupt(self, state, target: int):
        """Bit 20 of the first element of rank `target`'s copy of the first parameter (a rank
        of the job as launched: once it was left out, nothing is flipped)."""
        if target == self.adapter.launched_ids[self.process_index]:
            with torch.no_grad():
                first = local_block(state.params[0]).view(-1)[:1]
                first.view(torch.int32).bitwise_xor_(1 << 20)
        return state

    def finish(self, state) -> None:
        """Eager: every step is done when it returns; the last stop vote is collected."""
        if self._stop_vote is not None:
            self._stop_vote[0].wait()

    # -- processes ---------------------------------------------------------------------------
    def gather_times(self, local: np.ndarray) -> np.ndarray:
        mine = torch.from_numpy(np.asarray(local, dtype=np.float64))
        every = [torch.empty_like(mine) for _ in self.participants]
        dist.all_gather(every, mine)
        return torch.stack(every).numpy()

    def stop_signal(self, step: int, received: int | None) -> int | None:
        """The largest signal number any rank had caught one step earlier: each step starts
        an all-reduce (max) of one integer and the next step reads it, so that it runs beside
        the step's work instead of holding it up (waited for, it took 1.7 ms per step on 4 gloo
        ranks sharing 2 cores at load 14)."""
        if len(self.participants) == 1:
            return received
        flag = torch.tensor([received or 0], dtype=torch.int32)
        started = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        previous, self._stop_vote = self._stop_vote, (started, flag)
        if previous is None:
            return None
        work, agreed = previous
        work.wait()
        return int(agreed) or None
