"""`trainspec train`: the default job (or any spec) with a progress bar, metrics and a summary."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainspec.cli.options import add_framework, ascii_number, at_least
from trainspec.cli.summary import print_summary
from trainspec.cli.train_spec import (
    announce, given_flags, initial_params, silent, spec_to_use, unwritable)
from trainspec.core import arrivals, registry, run_lock, user_model
from trainspec.core.sinks import check_sinks
from trainspec.core.errors import JobLeavesNow, LeaveNow, UserInputError
from trainspec.core.exclusion import exclude
from trainspec.core.faults import Faults
from trainspec.core.launch import run as launch
from trainspec.core.run_files import discard_if_unused, first_missing, refuse_foreign_checkpoints
from trainspec.core.spec import load_spec
from trainspec.core.spec_bounds import MAX_DEVICES, MAX_STEPS
from trainspec.core.store import check_resumable


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
    p.add_argument("--host-devices", type=at_least(1),
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
    add_framework(p, "the backend that trains")
    p.add_argument("--nprocs", type=at_least(1),
                   help="ranks to start, for a backend that starts its own (torch) when this "
                   "process is not already one rank of a job (default: the backend's; torch: "
                   "4 on CPU, one per GPU)")
    p.set_defaults(func=run)


def _steps(text: str) -> int:
    value = at_least(1)(text)
    if value > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_STEPS} (train.steps' bound), "
                                         f"got {value}")
    return value


def _device_ids(text: str) -> list[int]:
    try:
        ids = [ascii_number(int, x) for x in text.split(",")]
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


def run(args) -> int:
    """The job on the backend `--framework` names; a start refused before anything was
    recorded (here, or by the ranks this command started) leaves no run dir that this
    command created."""
    created = first_missing(args.run_dir)
    try:
        status = _run(args)
    except UserInputError:
        _discard_if_unused(created)
        raise
    if status != 0:  # the ranks this command started failed: each said why
        _discard_if_unused(created)
    return status


def _discard_if_unused(created: Path | None) -> None:
    if created is not None:
        discard_if_unused(created, (run_lock.LOCK_FILE, arrivals.MARKS_DIR))


def _run(args) -> int:
    """The job on the backend `--framework` names: started here as ranks when the backend
    asks for them (each runs this command again and joins the job), else run in this process."""
    backend = registry.backend(args.framework)
    backend.capabilities.check_flags(given_flags(args))
    if args.summary_json is not None and args.summary_json.is_dir():  # found before training,
        raise UserInputError(f"--summary-json {args.summary_json} is a directory; name a file")
    ranks = backend.ranks_to_start(args.nprocs)
    backend.present_devices(args.host_devices)
    # said once: by the command that starts the ranks, else by the job's writer once joined
    notes: list[str] = []
    spec_path = spec_to_use(args, notes.append)
    spec = load_spec(Path(spec_path), args.overrides)  # before the job: it sets the timeout
    check_sinks(spec)  # found only when records are first written, after the run's files
    if args.exclude_devices:
        spec = exclude(spec, args.exclude_devices)  # devices (ranks) of the job as launched
    model = user_model.load(args.model, spec) if args.model else None  # checked before ranks
    spec = user_model.spec_for(spec, model)
    if ranks is not None:
        backend.check_model(spec, model)  # before the ranks take any memory
        for note in notes:
            announce(note)
        initial_params(args, spec, announce)  # checked once, before the ranks start
        return _start_ranks(args, backend, spec, model, ranks)
    runtime = backend.runtime(spec.collectives.timeout_s)
    runtime.join()  # a no-op unless this process is one of several
    args.speaks_for_job = runtime.speaks_for_job
    # a backend whose command starts its ranks said the notes there
    say = announce if runtime.is_writer() and not backend.starts_ranks else silent
    for note in notes:
        say(note)
    backend.check_model(spec, model)  # before the model takes any memory
    check_output_paths(args.run_dir, args.run_dir / spec.metrics.path)
    init_from = initial_params(args, spec, say)
    _hold_the_lock(runtime, args.run_dir)  # before anything is written there
    try:
        summary = backend.train(
            spec, args.run_dir, runtime, steps=args.steps, spec_label=str(spec_path),
            progress=not args.quiet, summary_json=args.summary_json, restart=args.restart,
            announce=announce, model=model, init_from=init_from,
            faults=Faults.from_env())  # nothing unless TRAINSPEC_FAULTS is set (tests)
    except OSError as err:  # a full disk, a run dir gone read-only: the metrics, spec, summary
        raise LeaveNow(unwritable(args.run_dir, err)) from None  # a save may still be writing
    finally:  # before the process goes: its peers see it leave, not a connection cut
        runtime.leave()
    if runtime.speaks_for_job():  # once per job, not once per process
        print_summary(summary)
    return 0


def _hold_the_lock(runtime, run_dir: Path) -> None:
    """The job's first process locks the run dir; the others write there (their step marks) only
    once it holds it, never into another run's. Every process learns the first's answer, so a
    refusal ends the whole job at once (said by the first), none left waiting on the others."""
    if runtime.process_count == 1:
        run_lock.hold(run_dir, True)
        return
    refusal = None
    try:
        run_lock.hold(run_dir, runtime.speaks_for_job())
    except UserInputError as err:
        refusal = str(err)
    refusal = next((said for said in runtime.gather_objects(refusal) if said), None)
    if refusal is not None:
        raise JobLeavesNow(refusal)


def _start_ranks(args, backend, spec, model, ranks: int) -> int:
    """Start `ranks` processes of this command, each one rank of the job."""
    backend.check_job(spec, ranks, own_model=model is not None)
    check_output_paths(args.run_dir, args.run_dir / spec.metrics.path)  # once, not per rank
    run_lock.hold(args.run_dir, True)  # held by the command that starts the job's ranks
    # The ranks would refuse these too, each in its own line: another framework's checkpoints,
    # no good one, or a spec they cannot resume under. Said once here, before any rank starts.
    refuse_foreign_checkpoints(args.run_dir / spec.checkpoint.dir, backend.name)
    if not args.restart:
        check_resumable(args.run_dir / spec.checkpoint.dir, spec)
    argv = list(args.argv)
    if "--nprocs" in argv:  # the ranks join; they do not start ranks of their own
        i = argv.index("--nprocs")
        del argv[i: i + 2]
    argv = [a for a in argv if not a.startswith("--nprocs=")]
    return launch([sys.executable, "-m", "trainspec.cli.main", *argv], ranks)
