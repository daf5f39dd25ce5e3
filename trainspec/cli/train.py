"""`trainspec train`: the default job (or any spec) with a progress bar, metrics and a summary."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from trainspec.cli.devices import ensure_host_devices
from trainspec.cli.summary import print_summary
from trainspec.cli.train_spec import (
    announce, given_flags, initial_params, leave_now, silent, spec_to_use, unwritable)
from trainspec.core import arrivals, run_lock
from trainspec.core.errors import UserInputError
from trainspec.core.host_memory import check_reference_model
from trainspec.core.spec_bounds import MAX_DEVICES, MAX_STEPS


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the reference model (or yours) under a spec")
    p.add_argument("--spec", type=Path, help="spec file (TOML); default: the spec the run dir was "
                   "last trained under (RUN_DIR/spec.toml), else the built-in spec")
    p.add_argument("--steps", type=_steps, help="optimizer steps (default: train.steps)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/default"),
                   help="output directory; a run directory with checkpoints is resumed from the "
                   "newest good one (on the current devices' mesh)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
        help="override one spec field (repeatable), e.g. --set mesh.axes.fsdp.size=2",
    )
    p.add_argument("--summary-json", type=Path, help="also write the summary to this JSON file")
    p.add_argument("--host-devices", type=_positive_int,
                   help="CPU devices to present (default 8, or as XLA_FLAGS says)")
    p.add_argument("--exclude-devices", type=_device_ids, default=[], metavar="ID,ID,...",
                   help="device ids not to use (added to mesh.exclude_devices); the mesh shrinks "
                   "to the largest that still satisfies the spec")
    p.add_argument("--restart", action="store_true",
                   help="train from step 0: move the run's checkpoints aside (kept, into "
                   "CHECKPOINT_DIR-quarantine) instead of resuming from them")
    p.add_argument("--model", metavar="MODULE:FN",
                   help="train your model and data instead of the reference job: FN(spec) in "
                   "MODULE (a .py file or a module) returns a trainspec.core.user_model.UserModel "
                   "(docs/wrapping.md)")
    p.add_argument("--init-from", type=Path, metavar="RUN_OR_FILE",
                   help="start the reference model from these parameters: a run directory's "
                   "initial_params.safetensors (either framework's run writes one) or such a "
                   "file; a run dir with checkpoints resumes instead (docs/adapters.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--framework", choices=("jax", "torch"), default="jax",
                   help="implementation that trains (default jax; torch: docs/adapters.md)")
    p.add_argument("--nprocs", type=_positive_int,
                   help="torch: ranks to start when not already one rank of a job (default 4 "
                   "on CPU, one per GPU)")
    p.set_defaults(func=run)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _steps(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_STEPS} (train.steps' bound), "
                                         f"got {value}")
    return value


def _device_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:  # an empty item too: "1,,2"
        raise argparse.ArgumentTypeError(f"expected device ids like 3,5, got {text!r}") from None
    if any(not 0 <= i < MAX_DEVICES for i in ids):
        raise argparse.ArgumentTypeError(f"expected device ids from 0 to {MAX_DEVICES - 1}, "
                                         f"got {text!r}")
    return ids


def check_output_paths(run_dir: Path, metrics_file: Path) -> None:
    """Refuse, before anything compiles, outputs that cannot be written: found after training,
    they cost the run (or surfaced as tracebacks from the writer and orbax's threads)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserInputError(f"--run-dir {run_dir} is a file, not a directory")
    if metrics_file.is_dir() or metrics_file.resolve() == run_dir.resolve():
        raise UserInputError(f"metrics.path: {metrics_file} is a directory; name a file")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # under /proc, on a read-only file system, a parent that is a file
        raise UserInputError(f"--run-dir {run_dir}: cannot create it ({err.strerror})") from None
    if not os.access(run_dir, os.W_OK):
        raise UserInputError(f"--run-dir {run_dir} is not writable")
    if os.statvfs(run_dir).f_bavail == 0:
        raise UserInputError(f"--run-dir {run_dir}: no space left on its file system")


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


def run(args) -> int:
    if args.framework == "torch":
        from trainspec.cli.train_torch import run as run_torch

        return run_torch(args)
    from trainspec.jax.capabilities import JAX

    JAX.check_flags(given_flags(args))
    if args.summary_json is not None and args.summary_json.is_dir():  # found before training,
        raise UserInputError(f"--summary-json {args.summary_json} is a directory; name a file")
    ensure_host_devices(args.host_devices)
    from trainspec.core.spec import load_spec

    notes: list[str] = []  # said once the job is joined, by its writer
    spec_path = spec_to_use(args, notes.append)
    spec = load_spec(Path(spec_path), args.overrides)  # before the job: it sets XLA's timeout
    import jax
    from jax.errors import JaxRuntimeError
    from trainspec.jax.distributed import initialize_from_env, is_writer

    # a no-op unless launched as one process of several
    initialize_from_env(spec.collectives.timeout_s)
    from trainspec.core.run_files import AlreadyTrained
    from trainspec.jax.train import run as train

    say = announce if is_writer() else silent  # once per job, not once per process
    for note in notes:
        say(note)
    from trainspec.core import user_model
    from trainspec.core.health import HealthHalt
    from trainspec.core.exclusion import exclude
    from trainspec.jax.health.faults import Faults
    from trainspec.jax.checkpoint import CheckpointSaveError
    from trainspec.core.loop import Preempted

    if args.model is None:  # before the reference model takes any memory
        check_reference_model(spec, state_on_host=jax.default_backend() == "cpu")
    if args.exclude_devices:
        spec = exclude(spec, args.exclude_devices)
    model = user_model.load(args.model, spec) if args.model else None
    if model is not None:
        from trainspec.jax.user_model_check import check_init

        check_init(model, spec.seed)
    check_output_paths(args.run_dir, args.run_dir / spec.metrics.path)
    init_from = initial_params(args, spec, say)
    run_lock.hold(args.run_dir, is_writer())  # before anything is written there

    def peer_lost(err: Exception) -> str:
        return arrivals.peer_lost_line(args.run_dir, jax.process_count(), jax.process_index(),
                                       arrivals.collective_of(str(err)),
                                       spec.collectives.timeout_s)

    with _failed_save_threads_quiet():  # until the process leaves on a failed save
        try:
            summary = train(
                spec,
                args.run_dir,
                steps=args.steps,
                spec_label=str(spec_path),
                progress=not args.quiet,
                summary_json=args.summary_json,
                faults=Faults.from_env(),  # nothing unless TRAINSPEC_FAULTS is set (tests)
                restart=args.restart,
                announce=say,
                model=model,
                init_from=init_from,
            )
        except AlreadyTrained as done:  # the run dir is where it was asked to be: not an error
            say(str(done))
            return 0
        except HealthHalt as halt:  # one clear line, saying where the last good state is
            print(f"trainspec: halted: {halt}", file=sys.stderr)
            return 3
        except Preempted as stop:  # the checkpoint is written: say where, exit 128 + signal
            print(f"trainspec: stopped: {stop}", file=sys.stderr)
            return stop.exit_status
        except CheckpointSaveError as err:  # a peer gone mid-save fails the save's gloo too
            leave_now(peer_lost(err) if arrivals.peer_lost(str(err)) else str(err))
        except OSError as err:  # a full disk, a run dir gone read-only: the metrics, spec, summary
            leave_now(unwritable(args.run_dir, err))
        except JaxRuntimeError as err:
            if not arrivals.peer_lost(str(err)):
                raise
            # A peer process stopped arriving; the job's other processes fail or wait in their
            # own collectives (`trainspec launch` stops them). The newest checkpoint stands.
            leave_now(peer_lost(err))
    if is_writer():  # once per job, not once per process
        print_summary(summary)
    return 0
