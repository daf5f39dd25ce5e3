"""The JAX backend as the trunk finds it (the `trainspec.backends` entry point `jax`): every
process runs the job on its own devices (`trainspec launch` starts several), the conformance
suite on this process's 8 devices. Imports jax only when a method runs."""
from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

from trainspec.core import arrivals
from trainspec.core.backend import Backend
from trainspec.core.errors import LeaveNow, UserInputError
from trainspec.core.host_memory import check_reference_model
from trainspec.jax.backends import BACKENDS
from trainspec.jax.capabilities import JAX


class JaxBackend(Backend):
    name = "jax"
    extra = "jax"
    framework_modules = ("jax", "jaxlib", "flax", "optax", "orbax")
    starts_ranks = False  # `trainspec launch` starts several processes
    conformance_targets = tuple(BACKENDS)  # one per collectives variant: xla, ext, hierarchical

    @property
    def capabilities(self):
        return JAX

    def ranks_to_start(self, nprocs: int | None) -> None:
        return None  # --nprocs is refused by the capability table

    def present_devices(self, host_devices: int | None) -> None:
        from trainspec.jax.devices import ensure_host_devices

        ensure_host_devices(host_devices)

    def runtime(self, timeout_s: float):
        from trainspec.jax.runtime import JaxRuntime

        return JaxRuntime(timeout_s)

    def check_job(self, spec, processes: int, own_model: bool) -> None:
        """Nothing before the job: each field is checked as the step is built."""

    def check_model(self, spec, model) -> None:
        import jax

        if model is None:
            check_reference_model(spec, state_on_host=jax.default_backend() == "cpu")
        else:
            from trainspec.jax.user_model_check import check_init

            check_init(model, spec.seed)

    def train(self, spec, run_dir: Path, runtime, **options) -> dict:
        import jax
        from jax.errors import JaxRuntimeError

        from trainspec.jax.checkpoint import CheckpointSaveError
        from trainspec.jax.train import run

        def peer_lost(err: Exception) -> str:
            """A peer process stopped arriving (`trainspec launch` stops the job's others);
            the newest checkpoint stands."""
            return arrivals.peer_lost_line(run_dir, jax.process_count(), jax.process_index(),
                                           arrivals.collective_of(str(err)),
                                           spec.collectives.timeout_s)

        with _failed_save_threads_quiet():  # until the process leaves on a failed save
            try:
                return run(spec, run_dir, **options)
            except CheckpointSaveError as err:  # a peer gone mid-save fails the save's gloo too
                raise LeaveNow(peer_lost(err) if arrivals.peer_lost(str(err))
                               else str(err)) from None
            except JaxRuntimeError as err:
                if not arrivals.peer_lost(str(err)):
                    raise
                raise LeaveNow(peer_lost(err)) from None

    def describe(self, spec, model, nprocs: int | None) -> list[str]:
        import jax

        from trainspec.jax import layout
        from trainspec.jax.train import build_abstract_job, user_job

        if model is not None:
            self.check_model(spec, model)
            run_step, abstract_state, _, _ = user_job(spec, model)
            step = run_step.wrapped
        else:
            step, abstract_state = build_abstract_job(spec)
        return [f"devices: {jax.device_count()} ({jax.devices()[0].platform})",
                "mesh: " + " x ".join(f"{k}={v}" for k, v in step.mesh.shape.items()),
                f"batch: global {spec.batch.global_batch}, micro {spec.batch.micro}, "
                f"{spec.batch.accumulation_steps} accumulation steps, sharded "
                f"{layout.batch_partition_spec(spec, step.mesh, 2)}",
                "logical rules: " + ", ".join(
                    f"{k}->{list(v)}" for k, v in layout.logical_rules(spec).items()),
                "layout (path, shape, partition spec):",
                *("  " + line for line in layout.describe(step.state_pspecs, abstract_state))]

    def trained_params(self, spec, run_dir: Path) -> tuple[dict, int] | None:
        """The newest good orbax checkpoint, restored onto this process's (host) devices."""
        self.present_devices(None)
        from trainspec.jax.export import trained_params

        return trained_params(spec, run_dir)

    def suite_ranks(self, devices: int) -> None:
        """The suite runs in this process, on `devices` CPU devices when there are no others."""
        self.present_devices(devices)

    def conformance(self, target: str, join: bool = True):
        from trainspec.jax.conformance import JaxConformance

        adapter = JaxConformance(target)
        if join:
            import jax

            from trainspec.core.conformance_runner import SUITE_DEVICES

            if jax.device_count() < SUITE_DEVICES:
                raise UserInputError(f"--impl {target}: the suite needs {SUITE_DEVICES} "
                                     f"devices, {jax.device_count()} present")
        return adapter


@contextlib.contextmanager
def _failed_save_threads_quiet():
    """A failed checkpoint save is reported as one line (CheckpointSaveError), but it leaves
    writes of that save still running on orbax's and tensorstore's threads, and each of them
    fails in turn: orbax logs them (absl), asyncio logs their futures that nobody awaits any
    more, and tensorstore's completion callbacks find orbax's event loop closed, each a
    traceback (sys.unraisablehook) printed before the run has said why it stops."""
    def orbax_error(record):
        return record.levelno >= logging.ERROR and "/orbax/" in record.pathname

    def unawaited_write(record):
        return (record.levelno >= logging.ERROR and record.exc_info is not None
                and isinstance(record.exc_info[1], OSError))

    def late_callback(unraisable):
        return (isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed")

    filters = [(logging.getLogger("absl"), lambda record: not orbax_error(record)),
               (logging.getLogger("asyncio"), lambda record: not unawaited_write(record))]
    hook = sys.unraisablehook
    for logger, keep in filters:
        logger.addFilter(keep)
    sys.unraisablehook = lambda unraisable: None if late_callback(unraisable) else hook(unraisable)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for logger, keep in filters:
            logger.removeFilter(keep)


BACKEND = JaxBackend()
