"""`trainspec train --framework torch`: the same job on PyTorch (trainspec/torch/).

Run alone, it checks the spec for the ranks it will start, then starts them through the same
launcher as `trainspec launch` (each rank runs this command again and joins the job); run as
one rank of a job (`trainspec launch`, torchrun), it trains as that rank.
"""
from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

from trainspec.core import arrivals, run_lock
from trainspec.core.errors import UserInputError

DEFAULT_CPU_RANKS = 4
SPEAKER_FIRST_S = 5.0


def run(args) -> int:
    from trainspec.torch.support import launched, rank_from_env
    from trainspec.torch.capabilities import TORCH
    from trainspec.cli.train_spec import (
        announce, given_flags, initial_params, leave_now, silent, spec_to_use, unwritable)
    from trainspec.core import user_model
    from trainspec.core.spec import load_spec

    TORCH.check_flags(given_flags(args))
    spec_path = spec_to_use(args, silent if launched() else announce)  # said once, by the launcher
    spec = load_spec(Path(spec_path), args.overrides)
    if args.exclude_devices:
        from trainspec.core.exclusion import exclude

        spec = exclude(spec, args.exclude_devices)  # ranks of the job as launched
    if args.model is None:  # before the reference model takes any memory
        import torch
        from trainspec.core.host_memory import check_reference_model

        check_reference_model(spec, state_on_host=not torch.cuda.is_available())
    model = user_model.load(args.model, spec) if args.model else None  # checked before ranks
    if model is not None and not launched():
        from trainspec.torch.user_model_check import check_init

        check_init(model)
    # checked (and its resume note said) once, before the ranks start; each rank reads it
    init_from = initial_params(args, spec, silent if launched() else announce)
    # held by the process that starts the job: this one, or the job's rank 0 when launched
    run_lock.hold(args.run_dir, rank_from_env() == 0)
    if not launched():
        return _start_ranks(args, spec, model)
    if args.nprocs is not None:
        raise UserInputError("--nprocs: this process is already one rank of a job")
    from trainspec.torch.train import run as train
    from trainspec.core.faults import Faults
    from trainspec.core.health import HealthHalt
    from trainspec.core.loop import Preempted
    from trainspec.core.run_files import AlreadyTrained
    from trainspec.core.store import NoGoodCheckpoint
    from trainspec.torch.adapter import TorchAdapter
    from trainspec.torch.members import LeftOut
    from torch.distributed.checkpoint.api import CheckpointException

    adapter = TorchAdapter(spec.collectives.timeout_s)

    def writer() -> bool:
        """Whether this process speaks for the job: the first of the ranks it has now (the
        job may have been re-formed without the launched rank 0)."""
        return (adapter.launched_ids or [0])[0] == rank_from_env()

    try:
        summary = train(spec, args.run_dir, steps=args.steps, spec_label=str(spec_path),
                        adapter=adapter, progress=not args.quiet, summary_json=args.summary_json,
                        announce=announce, restart=args.restart, model=model,
                        init_from=init_from,
                        faults=Faults.from_env())  # nothing unless TRAINSPEC_FAULTS is set (tests)
    except AlreadyTrained as done:  # the run dir is where it was asked to be: not an error
        if writer():
            announce(str(done))
        return 0
    except NoGoodCheckpoint as refusal:  # every rank decided it alike: said once
        if writer():
            print(f"trainspec: error: {refusal}", file=sys.stderr)
        return 2
    except LeftOut as out:  # the others train on without this rank
        print(f"trainspec: {out}", file=sys.stderr)
        return 0
    except HealthHalt as halt:  # every rank halts on the same: said once
        if writer():
            print(f"trainspec: halted: {halt}", file=sys.stderr)
        return 3
    except Preempted as stop:  # the checkpoint is written: say where, exit 128 + signal
        if writer():
            print(f"trainspec: stopped: {stop}", file=sys.stderr)
        return stop.exit_status
    except OSError as err:  # a full disk, a run dir gone read-only: the records, the spec
        leave_now(unwritable(args.run_dir, err))  # a background save may still be writing
    except RuntimeError as err:  # gloo: a peer that did not arrive or went away
        if not arrivals.peer_lost(str(err)):
            raise
        leave_now(arrivals.peer_lost_line(args.run_dir, len(adapter.launched_ids),
                                          rank_from_env(), _collective(err),
                                          spec.collectives.timeout_s))
    except CheckpointException as err:  # every rank gets it (DCP gathers the ranks' errors)
        if writer():
            leave_now(save_failed(spec, args.run_dir, err))
        # The writer says it for the job. Leaving first, this rank would have the launcher
        # stop the writer before it has.
        time.sleep(SPEAKER_FIRST_S)
        leave_now(None)
    if writer():
        from trainspec.cli.summary import print_summary

        print_summary(summary)
    return 0


def _collective(err: BaseException) -> str:
    """The torch.distributed collective `err` was raised in ("all_reduce"), from its
    traceback."""
    import traceback

    names = [frame.name for frame in traceback.extract_tb(err.__traceback__)
             if frame.filename.endswith("distributed_c10d.py") and not frame.name.startswith("_")]
    return names[-1] if names else "collective"


def save_failed(spec, run_dir: Path, err) -> str:
    """The line for a checkpoint that could not be written (DCP's CheckpointException holds
    each failing rank's exception; torch.save on a full disk says only "unexpected pos")."""
    directory = run_dir / spec.checkpoint.dir
    ranks = ", ".join(str(r) for r in sorted(err.failures))
    first, _trace = next(iter(err.failures.values()))
    why = (os.strerror(errno.ENOSPC) if disk_full(directory)
           else f"{type(first).__name__}: {str(first).strip().splitlines()[0][:200]}")
    return (f"checkpoint.dir: saving to {directory} failed on rank(s) {ranks}: {why}; the "
            "newest good checkpoint there is kept")


def disk_full(path: Path) -> bool:
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False


def _start_ranks(args, spec, model) -> int:
    from trainspec.torch.support import check_run, ranks_kept
    from trainspec.core.launch import run as launch
    from trainspec.core.run_files import refuse_foreign_checkpoints
    from trainspec.core.store import check_resumable

    nprocs = args.nprocs or default_ranks()
    kept = ranks_kept(spec, nprocs, spec.mesh.exclude_devices)  # the ranks that will train
    check_run(spec, len(kept), own_model=model is not None)  # one line here, not one per rank
    # The ranks would refuse these too, each in its own line: another framework's checkpoints,
    # no good one, or a spec they cannot resume under. Said once here, before any rank starts.
    refuse_foreign_checkpoints(args.run_dir / spec.checkpoint.dir, "torch")
    if not args.restart:
        check_resumable(args.run_dir / spec.checkpoint.dir, spec)
    argv = list(args.argv)
    if "--nprocs" in argv:  # the ranks join; they do not start ranks of their own
        i = argv.index("--nprocs")
        del argv[i: i + 2]
    argv = [a for a in argv if not a.startswith("--nprocs=")]
    return launch([sys.executable, "-m", "trainspec.cli.main", *argv], nprocs)


def default_ranks() -> int:
    import torch

    return torch.cuda.device_count() or DEFAULT_CPU_RANKS
