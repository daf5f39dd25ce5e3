"""The backend contract: what one framework provides to the trunk (docs/adapters.md).

The trunk (trainspec.core, the CLI) decides; a backend runs steps and moves bytes. Its parts,
each a module of the same name in every backend's package (trainspec/jax, trainspec/torch):

- `runtime`: the job's processes and devices: join, leave, the process grid, device ids,
  gathering small objects (`Runtime` below);
- `mesh`: the spec's mesh as the framework's own device-mesh object;
- `engine`: a built step as the run loop drives it (`Engine` below, driven by
  trainspec.core.run.Run), made of small parts: run it (`Stepping`), bring its values to the
  host (`HostValues`), trace it (`Tracing`), check values and state for non-finite elements
  (`FiniteChecks`), compare replica fingerprints and corrupt a copy for fault tests
  (`ReplicaChecks`), agree with the job's other processes (`JobProcesses`);
- `checkpoint`: the byte-moving half of checkpoints under the trunk's checkpoint policy
  (trainspec.core.loop.Checkpointer);
- `capabilities`: what it does with every field of the spec and every flag of `trainspec train`
  (trainspec.core.capabilities);
- `collectives`: the spec's collectives on the framework's groups (`Collectives` below);
- `models`, `train`: the reference models (the transformer, its mixture-of-experts MLP) and
  the reference job in the run loop;
- `backend`: the `Backend` object the package registers under the `trainspec.backends` entry
  points (pyproject.toml), which the CLI finds through trainspec.core.registry.

Framework-free: imports neither jax nor torch, nor any backend.
"""
from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from trainspec.core.capabilities import Capabilities
from trainspec.core.errors import UserInputError

GUARANTEES = ("deterministic", "nondeterministic")  # docs/spec.md, section 4
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "permute")


class Runtime(abc.ABC):
    """The job's processes and devices, as this process sees them."""

    def join(self) -> None:
        """Join the job the environment describes (a one-process job when it describes none);
        nothing when the framework's runtime is already up."""

    def leave(self) -> None:
        """Leave the job this runtime joined (nothing for a job joined elsewhere)."""

    @abc.abstractmethod
    def process_grid(self) -> tuple[int, int]:
        """This process's index and the job's number of processes (known only once the job is
        joined, so asked each time)."""

    @property
    def process_index(self) -> int:
        return self.process_grid()[0]

    @property
    def process_count(self) -> int:
        return self.process_grid()[1]

    @abc.abstractmethod
    def device_ids(self) -> list[int]:
        """Global ids of every device of the job, in the order meshes are laid out over."""

    @abc.abstractmethod
    def gather_objects(self, obj) -> list:
        """Every process's `obj` (JSON-able), in process order, on every process."""

    def is_writer(self) -> bool:
        """This process writes the job's shared files (process 0)."""
        return self.process_index == 0

    def speaks_for_job(self) -> bool:
        """Whether this process says the job's lines at the end of a command (once the job
        may have been left): its writer."""
        return self.is_writer()


class Collectives(abc.ABC):
    """The spec's collectives on NumPy blocks, for the conformance suite: programs use the
    framework's own in-program form (trainspec.jax.collectives, trainspec.torch.collectives).

    Collectives act on the calling member's block, over the mesh axes `axes` (one name or a
    tuple, ranked row-major in the tuple's order, like `lax.axis_index`), with the tiled
    semantics of trainspec/core/collectives_reference.py, their arguments validated by
    trainspec.core.collective_calls.check_call before anything is communicated."""

    name: str
    # op -> the guarantee level declared for it (docs/spec.md, section 4)
    guarantee_levels: dict[str, str]
    # the compressions (besides "none") offered; none: the suite skips those families
    compressions: tuple[str, ...] = ()

    @abc.abstractmethod
    def run_collective(self, mesh_shape, mesh_axes, collective: str, blocks, dtype: str, axes,
                       **kwargs) -> dict[tuple[int, ...], Any]:
        """Run `collective` over `axes` of a row-major grid of the job's first
        prod(mesh_shape) devices named `mesh_axes`, every member on its block of `blocks`
        (NumPy, (*mesh_shape, *local)) cast to `dtype`. Returns {member coordinates: result
        widened to float64 (int64 for int32)} for the members this process holds."""

    @abc.abstractmethod
    def round_trip(self, x, dtype: str):
        """NumPy `x` cast to the framework's `dtype` and widened back (what a member holds)."""

    def error_feedback(self, x, residual, compression: str, block: int):
        """One replica's compression step on float32 NumPy vectors `x` and `residual`: (what
        the other replicas receive of x + residual, dequantized, float32; the replica's new
        residual, float32), as its gradient reduction computes them."""
        raise NotImplementedError(f"{self.name} implements no collectives.compression")


class Stepping(Protocol):
    """Running the step: train, evaluate, wait for the queued work."""

    eval_data: Any             # eval batch i (this process's rows) under [eval]; None: none

    def __call__(self, state, batch) -> tuple[Any, dict]: ...

    def evaluate(self, state, batch) -> tuple[float, float]:
        """The held-out loss sum and valid tokens of `batch` under `state` (no update)."""

    def finish(self, state) -> None:
        """Wait for the step's work to be done (asynchronous dispatch)."""


class HostValues(Protocol):
    """The step's values on the host, for the records (trainspec.core.recorder) and summary."""

    gns_note: str | None       # why the gradient noise scale is not measured (None: it is)

    def facts(self, state, batch) -> dict:
        """The record's static fields (FLOPs, peak, memory, communication, compile time),
        measured once for this step on this batch's shapes (it may compile the step)."""

    def per_record(self) -> dict:
        """Fields measured afresh at every record (live memory)."""

    def to_host(self, tree) -> Any:
        """The tree's values as host numbers: a record's one synchronisation. Under
        [semi_sync], metrics hold one value per group (trainspec.core.semi_sync combines)."""

    def learning_rate(self, updates: int) -> float | None:
        """The schedule's rate for update number `updates` (0-based); None when unknown."""

    def summary_fields(self) -> dict:
        """Fields of the backend's own for the run summary."""


class Tracing(Protocol):
    """[profile]: a trace of the steps the spec names (trainspec.core.profile)."""

    def start_trace(self, directory: Path) -> None:
        """Start the framework's profiler, its trace to go into `directory`."""

    def stop_trace(self) -> None:
        """Stop it and write the trace."""


class FiniteChecks(Protocol):
    """Reading non-finite values: the policy (skip, halt, rollback) is trainspec.core.health's
    and trainspec.core.bad_steps'; the backend counts and reads on its devices."""

    def reset_guard(self, step: int, skipped: int, consecutive: int) -> None:
        """Start the non-finite guard `step` steps in, with a checkpoint's counts."""

    def check_nonfinite(self) -> int:
        """Raise HealthHalt if the non-finite guard tripped; else the steps it skipped."""

    def nonfinite_counts(self) -> dict[str, int]:
        """The guard's counts to checkpoint with the state."""

    def verdict_inputs(self, metrics) -> Any:
        """What judges this step under health.nan.policy = rollback (its loss and gradient
        norm, not yet read: no sync); None when the step carries no guard."""

    def read_verdicts(self, inputs: list) -> list[tuple[bool, float | None]]:
        """(the gradient norm finite, the loss) on the host for each of several steps'
        `inputs`, in one read."""

    def state_is_finite(self, state) -> bool:
        """Every floating element of the state finite, the same answer on every process."""


class ReplicaChecks(Protocol):
    """Replica fingerprints (trainspec.core.fingerprint), and the fault that tests them."""

    def check_replicas(self, state, step: int, last_good_step: int | None) -> None:
        """Raise ReplicaMismatch naming the copies that differ from their majority."""

    def corrupt(self, state, target: int):
        """Fault injection: `state` with one bit flipped in `target`'s (device or rank) copy."""


class JobProcesses(Protocol):
    """This process among the job's: who writes, who is compared, what they agree on."""

    is_writer: bool            # writes the run's files (process 0)
    process_index: int
    participants: list[str]    # the processes whose step times are compared (stragglers)
    local_signals: bool        # whether the loop catches SIGTERM/SIGINT in this process

    def gather_times(self, local: np.ndarray) -> np.ndarray:
        """Every process's step times (processes x steps) from this process's `local` ones."""

    def stop_signal(self, step: int, received: int | None) -> int | None:
        """The signal to stop for after `step`, the same on every process (`received`: the
        one this process caught, if any)."""


class Engine(Stepping, HostValues, Tracing, FiniteChecks, ReplicaChecks, JobProcesses, Protocol):
    """A built step as trainspec.core.run.Run drives it (trainspec.jax.engine.JaxEngine,
    trainspec.torch.engine.TorchEngine): the parts above, each a cohesive few methods that one
    piece of the trunk uses (the recorder reads HostValues, the rollbacks FiniteChecks and
    ReplicaChecks, the profile window Tracing, stragglers and stop signals JobProcesses).
    `state` is the backend's own: a pytree, or a module with its optimizer. The decisions
    around it (records, the non-finite and rollback policy, checkpoints, combining semi-sync
    groups) are the trunk's."""

    framework: str             # "jax", "torch": named in records and summaries
    spec: Any                  # the spec it runs (after any exclusion of devices)
    mesh_shape: dict[str, int]


class Backend(abc.ABC):
    """One framework as the CLI uses it: `trainspec train --framework NAME`, `validate`,
    `conformance --impl TARGET`. Subclasses set `name`, `extra` and `conformance_targets`;
    every method imports its framework only when called, so that the registry can list
    backends whose framework is not installed."""

    name: str                  # --framework NAME
    extra: str                 # the pip extra that installs its framework
    framework_modules: tuple[str, ...]  # the top-level modules that extra brings
    # whether a command run alone starts the job's processes itself (ranks_to_start); the
    # command then says its notes once, and the ranks it starts stay silent
    starts_ranks: bool
    conformance_targets: tuple[str, ...]  # the --impl names it answers (collectives variants)

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """Its capability table (framework-free)."""

    @abc.abstractmethod
    def ranks_to_start(self, nprocs: int | None) -> int | None:
        """How many processes the command must start, each running it again as one rank of
        the job (`--nprocs`, or the backend's default); None when this process runs the job
        itself (it is one rank already, or the backend runs on this process's devices)."""

    @abc.abstractmethod
    def present_devices(self, host_devices: int | None) -> None:
        """Make `--host-devices` CPU devices visible before the framework starts (a backend
        that takes no such flag refuses it through its capability table first)."""

    @abc.abstractmethod
    def runtime(self, timeout_s: float) -> Runtime:
        """The job's runtime, not joined yet; `timeout_s`: the spec's collectives.timeout_s."""

    @abc.abstractmethod
    def check_job(self, spec, processes: int, own_model: bool) -> None:
        """Refuse, in one line before any rank starts, a spec this backend cannot run on
        `processes` processes (`own_model`: a user's model, not the reference one)."""

    @abc.abstractmethod
    def check_model(self, spec, model) -> None:
        """Refuse, before any memory is taken, the reference model that cannot fit the host
        (where the state lives on the host) or a user's `model` whose init fails."""

    @abc.abstractmethod
    def train(self, spec, run_dir: Path, runtime: Runtime, **options) -> dict:
        """Train in the joined job (trainspec.core.loop.train around the backend's engine and
        checkpoints): options as trainspec.jax.train.run takes them. Returns the summary;
        raises the trunk's outcomes (AlreadyTrained, HealthHalt, Preempted, LeftOut,
        LeaveNow)."""

    @abc.abstractmethod
    def describe(self, spec, model, nprocs: int | None) -> list[str]:
        """`trainspec validate`'s lines: the devices or ranks, the mesh, the batch's split and
        the parameter layout of the reference model (or the user's `model`)."""

    @abc.abstractmethod
    def conformance(self, target: str, join: bool = True):
        """The trainspec.core.adapter.Adapter the suite runs against for `target` (one of
        `conformance_targets`), in the joined job; `join=False`: for reading its
        declarations only, no devices touched."""

    def trained_params(self, spec, run_dir: Path) -> tuple[dict, int] | None:
        """(the reference model's parameters by flax path as NumPy arrays, the step) of the
        newest good checkpoint this backend wrote in `run_dir`, read whole in this process
        (`trainspec export`); None where there is none (the trunk says so)."""
        raise UserInputError(f"export: the {self.name} backend exports no checkpoints")

    def suite_ranks(self, devices: int) -> int | None:
        """The processes to start for a conformance run over `devices` devices, or None when
        this process holds them (or is one of those processes already)."""
        return None
