"""Which spec `trainspec train` runs under, and the one-line notes it prints on the way
(framework-free: the JAX and the torch commands share it)."""
from __future__ import annotations

import sys
from pathlib import Path


def spec_to_use(args, say) -> Path:
    """--spec; else the spec the run dir was last trained under (`say`s so in one line: a
    resume continues on its own layout); else the built-in spec."""
    from trainspec.core.spec import DEFAULT_SPEC_PATH
    from trainspec.core.run_files import saved_spec

    if args.spec is not None:
        return args.spec
    saved = saved_spec(args.run_dir)
    if saved is None:
        return DEFAULT_SPEC_PATH
    say(f"spec: {saved}, the one this run dir was trained under (--spec chooses another)")
    return saved


def given_flags(args) -> dict[str, object]:
    """The flags with their values, keyed as the capability tables name them
    ('--exclude-devices': an option whose destination is its own name)."""
    return {"--" + dest.replace("_", "-"): value for dest, value in vars(args).items()}


def announce(line: str) -> None:
    print(f"trainspec: {line}", file=sys.stderr, flush=True)


def silent(line: str) -> None:
    pass


def initial_params(args, spec, say):
    """--init-from's parameters, checked against the spec's model (UserInputError, one line,
    when they do not fit), or None without it. Read even when the run dir resumes (`say`s
    that it does): a wrong path or file is refused whether or not this run needs it."""
    if args.init_from is None:
        return None
    from trainspec.core import params_file

    params = params_file.read(args.init_from, spec.model)
    note = None if args.restart else params_file.resume_note(
        args.init_from, args.run_dir / spec.checkpoint.dir)
    if note:
        say(note)
    return params


def unwritable(run_dir: Path, err: OSError) -> str:
    """The line for a write into the run dir that failed (a full disk, a read-only one)."""
    return (f"--run-dir {run_dir}: {err.strerror or err}"
            + (f" ({err.filename})" if err.filename else ""))
