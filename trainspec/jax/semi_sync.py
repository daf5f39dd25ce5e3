"""Semi-synchronous training (`[semi_sync]`; DiLoCo, Douillard et al. 2023): docs/communication.md.

Every data-parallel group (one index along the data axes) keeps its own copy of the train state
and takes `inner_steps` (H) steps with the inner optimizer on its rows of each batch, reducing
gradients only over its own fsdp/tensor axes: the inner program has no collective over the data
axes at all (its metrics and non-finite guards stay per group; the host combines them when it
reads them). Every H steps the outer program averages the groups'
parameter deltas `anchor - params` over the data axes (through `collectives.backend`, with
`collectives.compression` and error feedback when set) and takes one SGD step with Nesterov
momentum from the anchor; the result is the new anchor and every group's parameters.

The state (`SemiSyncState`) holds the groups' train states stacked on a leading axis split over
the data axes, the anchor and the outer momentum (laid out like the parameters), and with
compression each group's residual: a checkpoint holds all of it, so a resume on the same mesh
continues bit for bit. The outer schedule follows the step count (an outer step after every
step that is a multiple of H), so a resume mid-round continues the round.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from trainspec.jax import init_checks, layout
from trainspec.jax.collectives import compression
from trainspec.core.errors import UserInputError
from trainspec.jax.health import nan as nan_guard
from trainspec.jax.metrics import comm
from trainspec.jax.step import WrappedStep
from trainspec.jax.step_forms import LossStep, Precision, accumulate, apply_update, split_micro


@flax.struct.dataclass
class SemiSyncState:
    inner: Any           # the groups' train states: every leaf (groups, *shape), split over data
    anchor: Any          # parameters after the last outer step, laid out like the parameters
    outer_momentum: Any  # the Nesterov buffer, float32, laid out like the parameters

    @property
    def params(self):
        """The model the groups agree on: the anchor."""
        return self.anchor


def _stacked(pspec: P, data) -> P:
    return P(data, *pspec)


def nesterov(anchor, mean_delta, momentum, lr: float, mu: float):
    """(new anchor, new momentum): SGD with Nesterov momentum on the pseudo-gradient
    `mean_delta` (as torch.optim.SGD(nesterov=True)): m = mu m + d; anchor -= lr (d + mu m)."""
    momentum = jax.tree.map(lambda m, d: mu * m + d, momentum, mean_delta)
    anchor = jax.tree.map(lambda a, d, m: (a.astype(jnp.float32) - lr * (d + mu * m)).astype(a.dtype),
                          anchor, mean_delta, momentum)
    return anchor, momentum


class Groups:
    """What the inner step (a WrappedStep with `groups=Groups()`) does per data-parallel group:
    the state stacked over the groups with the anchor and outer momentum beside it, each group's
    loss step on its own rows with no reduction over the data axes, one non-finite guard per
    group, and the groups' metrics combined on the host. `step` is that inner step."""

    # -- state --------------------------------------------------------------------------------
    @staticmethod
    def plan(step: WrappedStep, init_fn, *args):
        with step.context():
            boxed = jax.eval_shape(init_fn, *args)
        init_checks.warn_unannotated(boxed, step.dims)
        pspecs = layout.state_partition_specs(boxed, step.spec, step.mesh)
        abstract = layout.strip_boxes(boxed)
        data = step.data_axes
        for path, ps in jax.tree_util.tree_leaves_with_path(
                pspecs.params, is_leaf=lambda x: isinstance(x, P)):
            if any(a in data for entry in ps for a in np.atleast_1d(entry) if a):
                raise UserInputError(
                    f"layout.rules: parameter {jax.tree_util.keystr(path)} is split over a data "
                    f"axis ({ps}); semi_sync keeps one copy of the parameters per data group")
        groups = step.replicas
        stack = lambda x: jax.ShapeDtypeStruct((groups, *x.shape), x.dtype)  # noqa: E731
        f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)  # noqa: E731
        is_p = lambda x: isinstance(x, P)  # noqa: E731
        abstract = SemiSyncState(jax.tree.map(stack, abstract), abstract.params,
                                 jax.tree.map(f32, abstract.params))
        step.state_pspecs = SemiSyncState(
            jax.tree.map(lambda ps: _stacked(ps, data), pspecs, is_leaf=is_p),
            pspecs.params, pspecs.params)
        if step.error_feedback:  # each group's residual of the delta exchange
            abstract = step._with_residual(abstract, jax.ShapeDtypeStruct)
            step.state_pspecs = compression.with_residual(step.state_pspecs, jax.tree.map(
                lambda ps: _stacked(ps, data), pspecs.params, is_leaf=is_p))
        step.state_shardings = layout.named(step.state_pspecs, step.mesh)
        return abstract

    def init(self, step: WrappedStep, init_fn, *args):
        """Every group starts from the same initial state; the anchor is its parameters."""
        planned = self.plan(step, init_fn, *args)
        groups = step.replicas

        def build(*a):
            state = layout.strip_boxes(init_fn(*a))
            inner = jax.tree.map(lambda x: jnp.broadcast_to(x, (groups, *jnp.shape(x))), state)
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            semi = SemiSyncState(inner, state.params, zeros)
            if step.error_feedback:
                semi = step._with_residual(semi, jnp.zeros)
            init_checks.check_same_structure(planned, semi)
            return semi

        with step.context():
            return jax.jit(build, out_shardings=step.state_shardings)(*args)

    # -- the inner program --------------------------------------------------------------------
    @staticmethod
    def loss_step_fn(step: WrappedStep, batch_shardings):
        """One step of every group on its own rows: `vmap` over a leading group axis bound to
        the data axes (as the replica-reduced step in trainspec.jax.replica_steps), and no reduction of the
        gradients over it."""
        spec, mesh, data = step.spec, step.mesh, step.data_axes
        k, n = spec.batch.accumulation_steps, step.replicas
        precision = Precision(jnp.dtype(spec.precision.compute), jnp.dtype(spec.precision.grad_reduce))
        inner_rules = layout.flax_rules(spec, without=data)
        loss_fn = step.step_fn.loss_fn

        def constrain(micro):  # each micro-batch split over the group's own batch axes
            return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(
                mesh, layout.batch_partition_spec(spec, mesh, np.ndim(x), without=data))), micro)

        def group_step(inner, rows):
            grad_sum, loss_sum, tokens, aux = accumulate(
                loss_fn, inner.params, split_micro(rows, k), precision, constrain)
            new_inner, metrics = apply_update(inner, grad_sum, loss_sum, tokens, aux)
            return new_inner, (loss_sum, tokens, metrics["grad_norm"], aux)

        def run(state, batch):
            per_group = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)
            with nn.logical_axis_rules(inner_rules):
                inner, (loss_sums, tokens, norms, aux) = jax.vmap(
                    group_step, spmd_axis_name=data)(state.inner, per_group)
            # Every metric stays per group, split over the data axes like the groups: reducing
            # them here would be an all-reduce over data every step. The host combines them
            # (trainspec.core.semi_sync); `loss_tokens` weights the groups' losses there.
            metrics = {"loss": loss_sums / jnp.maximum(tokens, 1.0), "valid_tokens": tokens,
                       "loss_tokens": tokens, "grad_norm": norms,
                       **({"aux": aux} if jax.tree.leaves(aux) else {})}
            return state.replace(inner=inner), metrics

        return run

    # -- the groups' metrics and non-finite guards ---------------------------------------------
    @staticmethod
    def guarded(step: WrappedStep, guard, state, new_state, metrics):
        """Each group keeps its own old inner state when its update is not finite (the anchor,
        momentum and residual change only in the outer program)."""
        inner, guard, metrics = nan_guard.guarded_groups(
            step.spec.health.nan, guard, state.inner, new_state.inner, metrics, step.mesh,
            step.state_pspecs.inner, step.data_axes)
        return new_state.replace(inner=inner), guard, metrics

    @staticmethod
    def to_host(tree):
        """The groups' values on the host. Where the groups span processes (jax.distributed),
        each process gathers every group's (a collective of its own, run only when the host
        reads metrics or the guard: at records and checkpoints, never inside the step)."""
        def fetch(x):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return np.asarray(multihost_utils.process_allgather(x, tiled=True))
            return np.asarray(jax.device_get(x))
        return jax.tree.map(fetch, tree)


class SemiSyncStep:
    """The groups' inner step (`groups`: a WrappedStep that runs every data-parallel group on
    its own, see Groups), and the outer program after every H-th step.

    `inner_steps_done` is the run's step count (set by `reset_guard`, as a resume does): the
    outer step is due after each step that is a multiple of H. Everything else a step offers
    (`init`, `shard_batch`, `host_metrics`, `check_nonfinite`, `mesh`, `state_shardings`, ...)
    is the inner step's."""

    def __init__(self, step_fn, spec, mesh=None, devices=None, *, nan_guard: bool = True):
        self.groups = WrappedStep(step_fn, spec, mesh, devices, nan_guard=nan_guard,
                                  groups=Groups())
        settings = spec.semi_sync
        self.inner_steps = settings.inner_steps
        if not isinstance(step_fn, LossStep):
            raise UserInputError("semi_sync: needs a step built with trainspec.jax.loss_step(loss_fn) "
                                 "(the groups' gradients must be visible)")
        if self.groups.replicas < 2:
            raise UserInputError(
                f"semi_sync: needs at least 2 data-parallel groups, the mesh gives "
                f"{self.groups.replicas} (data axes {self.mesh_sizes('data')}); one group would "
                "be a single worker with an outer optimizer, not semi-synchronous training")
        if spec.layout.optimizer_state == "shard_over_data":
            raise UserInputError(
                "layout.optimizer_state: shard_over_data splits the optimizer state over the data "
                "groups, which semi_sync keeps one per group; use like_params")
        if spec.metrics.gns:
            raise UserInputError("metrics.gns = true cannot be measured under semi_sync: no "
                                 "gradient is reduced over the data-parallel groups")
        self.groups.gns_source = None
        self.groups.gns_note = "semi_sync: no gradient is reduced across groups"
        self.inner_steps_done = 0
        self._outer = self._outer_compiled = None
        self.program_bytes: dict[str, float] = {}  # set when the programs are measured

    def __getattr__(self, name: str):
        # only for what this class does not define: the inner step's (see the class docstring)
        if name == "groups":  # not set yet (inside __init__)
            raise AttributeError(name)
        return getattr(self.groups, name)

    def mesh_sizes(self, role: str) -> str:
        dims = self.groups.dims
        return ", ".join(f"{a}={dims.shape[a]}" for a in dims.axes_with_role(role))

    # -- the outer program --------------------------------------------------------------------
    def _outer_fn(self, state):
        """Mean of the groups' deltas `anchor - params` over the data axes, one Nesterov step
        from the anchor; every group continues from the new anchor (its inner optimizer state
        is its own and kept)."""
        settings, n = self.spec.semi_sync, self.groups.replicas
        deltas = jax.tree.map(lambda a, p: a[None].astype(jnp.float32) - p.astype(jnp.float32),
                              state.anchor, state.inner.params)
        if self.groups.error_feedback:
            total, residual = self.groups._reduce_over_replicas(deltas, state.ef_residual)
            state = state.replace(ef_residual=residual)
        else:
            total = self.groups._reduce_over_replicas(deltas)
        mean = jax.tree.map(lambda t: t / n, total)
        anchor, momentum = nesterov(state.anchor, mean, state.outer_momentum,
                                    settings.outer_lr, settings.outer_momentum)
        params = jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), anchor)
        return state.replace(inner=state.inner.replace(params=params), anchor=anchor,
                             outer_momentum=momentum)

    def outer_program(self):
        """The jitted outer step (state -> state), donated and laid out like the state."""
        if self._outer is None:
            shardings = self.groups.state_shardings
            self._outer = jax.jit(self._outer_fn, in_shardings=(shardings,),
                                  out_shardings=shardings, donate_argnums=(0,))
        return self._outer

    def compile(self, state, batch):
        """Compile the inner program (returned) and the outer one; both run from now on."""
        compiled = self.groups.compile(state, batch)
        with self.groups.context():
            self._outer_compiled = self.outer_program().lower(state).compile()
        return compiled

    def comm_volume(self, compiled) -> comm.CommVolume:
        """Per step, amortised: the inner program's collectives, and the outer program's
        counted 1/H times per step."""
        inner = self.groups.comm_volume(compiled)
        if self._outer_compiled is None:
            return inner
        outer = comm.analyze_compiled(self._outer_compiled, self.groups.mesh)
        self.program_bytes = {"inner_comm_bytes_per_step": inner.total_bytes,
                              "outer_comm_bytes": outer.total_bytes,
                              "outer_comm_bus_bytes": outer.bus_bytes}
        return comm.CommVolume(
            inner.collectives + [c.repeated(1 / self.inner_steps) for c in outer.collectives],
            inner.unknown_trip_counts + outer.unknown_trip_counts)

    def programs(self, compiled) -> list:
        """The inner program and, once compiled, the outer one."""
        return [compiled] + ([self._outer_compiled] if self._outer_compiled is not None else [])

    # -- running ------------------------------------------------------------------------------
    def reset_guard(self, step: int = 0, skipped: int = 0, consecutive: int = 0) -> None:
        """Every group's guard starts from these counts (a checkpoint keeps the largest)."""
        self.groups.reset_guard(step, skipped, consecutive)
        self.inner_steps_done = step

    def __call__(self, state, batch):
        state, metrics = self.groups(state, batch)
        self.inner_steps_done += 1
        if self.inner_steps_done % self.inner_steps == 0:
            with self.groups.context():
                state = (self._outer_compiled or self.outer_program())(state)
        return state, metrics

    def summary(self) -> dict[str, Any]:
        """The run summary's `semi_sync` entry: schedule and each program's bytes."""
        return {"inner_steps": self.inner_steps, "groups": self.groups.replicas,
                **self.program_bytes}
