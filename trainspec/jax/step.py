"""wrap(step_fn, spec): the user's train step, jitted, placed and accumulated per the spec.

Two ways in, one machinery (docs/wrapping.md):
- an opaque `(state, batch) -> (state, metrics)` function: placement, donation, sharded init;
- `loss_step(loss_fn)`, built from `loss_fn(params, batch) -> (loss_sum, valid_tokens, aux)`
  with the optax optimizer inside a flax `TrainState`: all of the above plus micro-batch
  accumulation normalised by the valid tokens of the whole global batch, and precision casts.
The step forms and their accumulation arithmetic are in trainspec.jax.step_forms, their functions
as this step runs them in trainspec.jax.replica_steps, the non-finite guard and the host's reads
in trainspec.jax.step_health.
"""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trainspec.jax import init_checks, layout, replica_steps
from trainspec.jax.batching import BatchPlacement
from trainspec.jax.backends import backend
from trainspec.jax.capabilities import JAX
from trainspec.jax.collectives import compression, replica_reduce, use_backend
from trainspec.core.capabilities import Request
from trainspec.core.errors import UserInputError
from trainspec.core.health import rolls_back
from trainspec.core.mesh import ParallelDims, check_batch
from trainspec.core.spec import Spec
from trainspec.jax.mesh import build_mesh, check_hierarchical, users_mesh
from trainspec.jax.pipeline import pipelined_loss_of
from trainspec.jax.metrics import comm, gns
from trainspec.jax.step_forms import GradStep, LossStep
from trainspec.jax.step_health import StepHealth

# Steps dispatched ahead of the host on a mesh of more than one device. XLA:CPU's runtime
# deadlocked with ~100 executions of a collective program in flight, ext's or XLA's own, and was
# fine with 10 (docs/xla_ext.md); XLA's own also deadlocked once with 40 (a user's loop of 40
# steps without a host read, on the loaded 2-core CI machine). Waiting on step s - 8 costs
# nothing the host was not already ahead of.
MAX_STEPS_IN_FLIGHT = 8


class WrappedStep(StepHealth):
    """The jitted, sharded step. Build state with `init`, feed host batches to `__call__`.

    `nan_guard` (default on): under `health.nan.policy = rollback` (the default) the step is
    its own output, unchanged; the run loop judges it a few steps late by its loss and gradient
    norm (`verdict_inputs`, `read_verdicts`), checks the state itself before each checkpoint
    (`state_is_finite`), and rolls back a bad step; under `skip` and
    `halt` an update whose loss, gradients or new state are not finite is dropped on device
    (state and `state.step` stay as they were), the metrics gain `nonfinite` and
    `skipped_steps`, and `check_nonfinite()` raises HealthHalt when the policy says halt. Off,
    the step's own output is returned unchanged (docs/wrapping.md).
    `devices`: run on these devices (or the first n) instead of all of them.
    `groups`: one state, step, guard and metrics per data-parallel group instead of one for all
    (trainspec.jax.semi_sync.Groups, the inner step of a SemiSyncStep); it plans and builds the
    state, gives the loss step, guards and reads back what the step computes.
    """

    def __init__(self, step_fn, spec: Spec, mesh: Mesh | None = None,
                 devices: int | Sequence[jax.Device] | None = None, *, nan_guard: bool = True,
                 groups=None):
        if spec.semi_sync is not None and groups is None:
            raise UserInputError("semi_sync: this step runs synchronously; wrap it with "
                                 "trainspec.jax.wrap, which runs semi_sync")
        self.step_fn, self.spec, self.groups = step_fn, spec, groups
        self.nan_guard = nan_guard
        self.rolls_back = nan_guard and rolls_back(spec.health.nan)
        if isinstance(devices, int):  # the first n devices (e.g. 1 of 8 simulated ones)
            devices = jax.devices()[:devices]
        self.mesh = users_mesh(spec, mesh) if mesh is not None else build_mesh(spec, devices)
        self.rules = layout.flax_rules(spec)
        # the mesh's axis sizes, roles and degrees, which everything below reads
        self.dims = ParallelDims.of(spec, self.mesh.shape)
        self.backend = backend(spec.collectives.backend)  # what its collectives can do
        check_batch(spec, self.dims, layout.batch_axes(spec, self.mesh))
        check_hierarchical(spec, self.mesh)
        self.pipelined = pipelined_loss_of(step_fn, self.dims)
        k = spec.batch.accumulation_steps
        if k > 1 and not isinstance(step_fn, LossStep):
            raise UserInputError(
                f"batch.micro_batch: {k} accumulation steps need a step built with "
                "trainspec.jax.loss_step(loss_fn); this step's loss cannot be accumulated "
                f"(set batch.micro_batch = {spec.batch.global_batch} to wrap it as it is)"
            )
        # What the spec asks that this implementation cannot run (its capability table): e.g.
        # the ext custom calls beside XLA's collectives inside a replica, which the CPU runtime
        # was seen to deadlock on (docs/collectives.md). Refused rather than hung.
        JAX.check(Request(spec, self.dims))
        # collectives.compression: each replica's residual rides in the state (error feedback)
        self.compressed = spec.collectives.compression != "none" and bool(self.data_axes)
        self.error_feedback = self.compressed and spec.collectives.error_feedback
        if self.compressed and not isinstance(step_fn, LossStep):
            raise UserInputError(
                f"collectives.compression: {spec.collectives.compression} needs a step built "
                "with trainspec.jax.loss_step(loss_fn)")
        # metrics.gns: where the small batch comes from, or why nothing is measured
        # A pipelined loss is not vmapped over replicas (its shard_map cannot run under
        # that vmap): its small batches are the micro-batches
        self.gns_source, self.gns_note = gns.resolve(
            spec.metrics.gns, 1 if self.pipelined else self.replicas, k,
            isinstance(step_fn, (LossStep, GradStep)))
        self.batches = BatchPlacement(spec, self.mesh)
        self.state_shardings = None
        self._jitted = None
        self._compiled = None  # set by compile(): the executable that then runs every step
        self.guard = None  # the nan_guard's record, carried from step to step on device
        self._state_check = None  # the compiled state check (`state_is_finite`)
        # Metrics of the steps still running, oldest first (only where a step meets in
        # collectives: more than one device).
        self._in_flight: collections.deque | None = (
            collections.deque() if self.mesh.size > 1 else None)

    @contextlib.contextmanager
    def context(self):
        """Mesh and logical rules for tracing (activation constraints in the model use them),
        and the spec's collectives for those the model makes (the experts' all-to-alls)."""
        collectives = self.spec.collectives
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules), \
                use_backend(collectives.backend, collectives.timeout_s):
            yield

    # -- state --------------------------------------------------------------------------------
    def plan(self, init_fn: Callable, *args):
        """Shardings of the state `init_fn(*args)` would build, without building it.

        Returns the abstract (possibly flax-boxed) state; sets `state_pspecs`/`state_shardings`.
        With a pipelined loss the state holds the blocks by stage (pipeline_params.Staged).
        """
        if self.groups is not None:
            return self.groups.plan(self, init_fn, *args)
        with self.context():
            abstract = jax.eval_shape(init_fn, *args)
        self.state_pspecs = layout.state_partition_specs(abstract, self.spec, self.mesh)
        init_checks.warn_unannotated(abstract, self.dims)
        if self.pipelined:  # each stage holds its own blocks (trainspec.jax.pipeline_params)
            form = self.pipelined.form
            abstract = jax.eval_shape(form.staged, layout.strip_boxes(abstract))
            self.state_pspecs = form.staged_pspecs(self.state_pspecs)
        if self.error_feedback:  # (replicas, *param) per parameter, split over the data axes
            abstract = self._with_residual(abstract, jax.ShapeDtypeStruct)
            self.state_pspecs = compression.with_residual(self.state_pspecs, jax.tree.map(
                lambda ps: P(self.data_axes, *ps), self.state_pspecs.params,
                is_leaf=lambda x: isinstance(x, P)))
        self.state_shardings = layout.named(self.state_pspecs, self.mesh)
        return abstract

    def init(self, init_fn: Callable, *args):
        """Run `init_fn(*args)` under jit with sharded outputs: the state is never whole on one
        device. `init_fn` may return flax-boxed (logically partitioned) leaves."""
        if self.groups is not None:
            return self.groups.init(self, init_fn, *args)
        planned = layout.strip_boxes(self.plan(init_fn, *args))

        def unboxed(*a):
            state = layout.strip_boxes(init_fn(*a))
            if self.pipelined:
                state = self.pipelined.form.staged(state)
            if self.error_feedback:
                state = self._with_residual(state, jnp.zeros)
            init_checks.check_same_structure(planned, state)  # while tracing: costs nothing
            return state

        with self.context():
            return jax.jit(unboxed, out_shardings=self.state_shardings)(*args)

    def _with_residual(self, state, make):
        params = layout.strip_boxes(state.params)
        return compression.with_residual(
            state, compression.residual_like(params, self.replicas, make))

    # -- batch --------------------------------------------------------------------------------
    def batch_sharding(self, ndim: int) -> NamedSharding:
        return self.batches.sharding(ndim)

    def shard_batch(self, batch):
        """Global arrays on the batch sharding, from host arrays (each process passes its own
        rows) or arrays on any devices; shapes are checked against the spec (trainspec.jax.batching)."""
        return self.batches.place(batch)

    # -- step ---------------------------------------------------------------------------------
    def _build(self, batch):
        batch_shardings = self.batches.shardings(batch)
        if isinstance(self.step_fn, LossStep) and self.groups is not None:
            fn = self.groups.loss_step_fn(self, batch_shardings)
        elif isinstance(self.step_fn, LossStep):
            fn = replica_steps.loss_step_fn(self, batch_shardings)
        elif isinstance(self.step_fn, GradStep) and self.gns_source == gns.REPLICAS:
            fn = replica_steps.grad_step_fn(self)
        else:
            fn = self.step_fn

        def guarded_step(state, guard, batch):  # health.nan: decided on device, no host sync
            new_state, metrics = fn(state, batch)
            if not self.nan_guard or self.rolls_back:  # rollback: judged by the run loop
                return new_state, guard, metrics
            return self._guarded(guard, state, new_state, metrics)

        return jax.jit(
            guarded_step,
            in_shardings=(self.state_shardings, self.guard_sharding, batch_shardings),
            out_shardings=(self.state_shardings, self.guard_sharding, self.metrics_sharding),
            donate_argnums=(0, 1),
        )

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the product of the data-role axes' sizes."""
        return self.dims.replicas

    def _reduce_over_replicas(self, stacked, residual=None):
        """Sum per-replica gradients through the spec's collectives backend, compressed per
        `collectives.compression` (trainspec.jax.collectives.replica_reduce)."""
        return replica_reduce.reduce_over_replicas(
            self.spec, self.mesh, self.data_axes, self.state_pspecs.params, self.replicas,
            self.compressed, stacked, residual)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The data-role mesh axes that actually split (size > 1)."""
        return self.dims.split("data")

    def lower(self, state, batch):
        """The lowered step for `batch` (host or global arrays), for cost and memory analysis."""
        batch = self.shard_batch(batch)  # host rows are this process's part, not the batch
        self._prepare(batch)
        with self.context():
            return self._jitted.lower(state, self.guard, batch)

    def lower_for_cost_analysis(self, state, batch):
        """The step lowered as one micro-batch of the whole global batch: the same arithmetic
        without the accumulation loop, whose body XLA's cost analysis would count only once.
        Uses this step's state shardings; compiles nothing."""
        if self.spec.batch.accumulation_steps == 1:
            return self.lower(state, batch)
        one_pass = self.spec.model_copy(update={
            "batch": self.spec.batch.model_copy(update={"micro_batch": self.spec.batch.global_batch}),
            # one pass has no micro-batches: GNS over them (metrics.gns = true) cannot apply
            "metrics": self.spec.metrics.model_copy(update={"gns": None})})
        flat = WrappedStep(self.step_fn, one_pass, self.mesh, nan_guard=self.nan_guard,
                           groups=self.groups)
        flat.state_pspecs, flat.state_shardings = self.state_pspecs, self.state_shardings
        return flat.lower(state, batch)

    def compile(self, state, batch):
        """Compile the step for these arguments and run that executable from now on.

        One compilation then serves both the run and its analysis (cost, memory and HLO in
        trainspec.jax.metrics): calling the jitted function after `lower().compile()` would compile
        a second time. Later batches must have the same shapes.
        """
        self._compiled = self.lower(state, batch).compile()
        return self._compiled

    def comm_volume(self, compiled) -> comm.CommVolume:
        """Collectives per step of `compiled` (this step's program), from its HLO."""
        return comm.analyze_compiled(compiled, self.mesh)

    def programs(self, compiled) -> list:
        """Every program the step runs, `compiled` (from `compile`) first."""
        return [compiled]

    def _prepare(self, batch) -> None:
        if self.state_shardings is None:
            raise RuntimeError("call init() first: the state's shardings come from it")
        if self._jitted is None:
            self._jitted = self._build(batch)
        if self.guard is None:
            self.reset_guard()

    def __call__(self, state, batch):
        # Per step only what must happen: place the batch (its shapes are checked once), and
        # one dispatch of the compiled step under the mesh context.
        batch = self.shard_batch(batch)
        if self._jitted is None or self.guard is None:
            self._prepare(batch)
        with self.context():
            state, self.guard, metrics = (self._compiled or self._jitted)(state, self.guard, batch)
        if self._in_flight is not None:
            self._in_flight.append(metrics)
            if len(self._in_flight) > MAX_STEPS_IN_FLIGHT:
                jax.block_until_ready(self._in_flight.popleft())
        return state, metrics

