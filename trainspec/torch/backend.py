"""The torch backend as the trunk finds it (the `trainspec.backends` entry point `torch`): one
device per rank; a command run alone starts its ranks through the launcher (each runs the same
command again and joins the job), a command run as one rank of a job (`trainspec launch`,
torchrun) trains as that rank. Imports torch only when a method runs."""
from __future__ import annotations

import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from trainspec.core import arrivals
from trainspec.core.backend import Backend
from trainspec.core.errors import LeaveNow, UserInputError
from trainspec.core.host_memory import check_reference_model
from trainspec.core.store import save_failed
from trainspec.torch.capabilities import TORCH

DEFAULT_CPU_RANKS = 4


class TorchBackend(Backend):
    name = "torch"
    extra = "torch"
    framework_modules = ("torch",)
    starts_ranks = True
    conformance_targets = ("torch",)

    @property
    def capabilities(self):
        return TORCH

    def ranks_to_start(self, nprocs: int | None) -> int | None:
        from trainspec.torch.support import launched

        if not launched():
            return nprocs or default_ranks()
        if nprocs is not None:
            raise UserInputError("--nprocs: this process is already one rank of a job")
        return None

    def present_devices(self, host_devices: int | None) -> None:
        """One device per rank: --host-devices is refused by the capability table."""

    def runtime(self, timeout_s: float):
        from trainspec.torch.runtime import TorchRuntime

        return TorchRuntime(timeout_s)

    def check_job(self, spec, processes: int, own_model: bool) -> None:
        """Every field for the ranks that will train (those left once `mesh.exclude_devices`
        are out): one line here, not one per rank."""
        from trainspec.torch.support import check_run, ranks_kept

        kept = ranks_kept(spec, processes, spec.mesh.exclude_devices)
        check_run(spec, len(kept), own_model=own_model)

    def check_model(self, spec, model) -> None:
        """A user's model's init is tried by the command that starts the ranks, not by each."""
        from trainspec.torch.support import launched

        if model is None:
            check_reference_model(spec, state_on_host=not _cuda_available())
        elif not launched():
            from trainspec.torch.user_model_check import check_init

            check_init(model)

    def trained_params(self, spec, run_dir: Path) -> tuple[dict, int] | None:
        """The newest good checkpoint, whatever world size wrote it, read whole here."""
        from trainspec.torch.export import trained_params

        return trained_params(spec, run_dir)

    def train(self, spec, run_dir: Path, runtime, **options) -> dict:
        from safetensors import SafetensorError

        from trainspec.torch.support import rank_from_env
        from trainspec.torch.train import run

        try:
            return run(spec, run_dir, adapter=runtime, **options)
        except RuntimeError as err:  # gloo: a peer that did not arrive or went away
            if not arrivals.peer_lost(str(err)):
                raise
            raise LeaveNow(arrivals.peer_lost_line(
                run_dir, len(runtime.launched_ids), rank_from_env(), _collective(err),
                spec.collectives.timeout_s)) from None
        except SafetensorError as err:  # this rank's checkpoint file (a full disk): said by it
            raise LeaveNow(save_failed(run_dir / spec.checkpoint.dir, err,
                                       rank_from_env())) from None

    def describe(self, spec, model, nprocs: int | None) -> list[str]:
        """Worked out on this process, no ranks started: the parameters are built on torch's
        meta device (shapes only, nothing allocated), as the ranks would build them."""
        import torch

        from trainspec.torch import describe
        from trainspec.torch.support import batch_axes, check_layout, check_run

        world = nprocs or default_ranks()
        check_run(spec, world, own_model=model is not None)
        if model is not None:
            from trainspec.torch.user_model_check import check_init

            check_init(model)
        dims = check_layout(spec, world)
        with torch.device("meta"):
            if model is None:
                from trainspec.torch.models.transformer import Transformer

                built, units = Transformer(spec.model), ("blocks.*",)
            else:
                built, units = model.init(), model.fsdp_units
        layout = describe.parameter_layout(dims, built, units, model and model.tensor_plan)
        return [f"ranks: {world} (torch)",
                "mesh: " + " x ".join(f"{k}={v}" for k, v in dims.shape.items()),
                f"batch: global {spec.batch.global_batch}, micro {spec.batch.micro}, "
                f"{spec.batch.accumulation_steps} accumulation steps, rows split over "
                f"{' x '.join(batch_axes(dims)) or 'nothing (every rank the whole batch)'}",
                "layout (parameter, shape, split, rank 0's block):",
                *("  " + line for line in describe.describe(layout))]

    def suite_ranks(self, devices: int) -> int | None:
        from trainspec.torch.support import launched

        return None if launched() else devices

    def conformance(self, target: str, join: bool = True):
        from trainspec.core.conformance_runner import SUITE_DEVICES
        from trainspec.torch.conformance import TorchConformance

        adapter = TorchConformance()
        if join:
            adapter.join()
            if adapter.process_count != SUITE_DEVICES:
                adapter.leave()
                raise UserInputError(f"--impl torch: the suite needs {SUITE_DEVICES} ranks, "
                                     f"the job has {adapter.process_count}")
        return adapter


def _collective(err: BaseException) -> str:
    """The torch.distributed collective `err` was raised in ("all_reduce"), from its
    traceback."""
    names = [frame.name for frame in traceback.extract_tb(err.__traceback__)
             if frame.filename.endswith("distributed_c10d.py") and not frame.name.startswith("_")]
    return names[-1] if names else "collective"


def default_ranks() -> int:
    if _cpu_only_build():
        return DEFAULT_CPU_RANKS
    import torch

    return torch.cuda.device_count() or DEFAULT_CPU_RANKS


def _cuda_available() -> bool:
    if _cpu_only_build():
        return False
    import torch

    return torch.cuda.is_available()


def _cpu_only_build() -> bool:
    """Whether the installed torch is a CPU-only build (the `+cpu` of its version), read from
    its metadata: the command that starts the ranks then knows no rank has a GPU without
    importing torch, about 2.5 s of CPU before any rank starts."""
    try:
        return version("torch").endswith("+cpu")
    except PackageNotFoundError:
        return False


BACKEND = TorchBackend()
