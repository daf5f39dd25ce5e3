"""The README's short tour runs top to bottom in a fresh directory.

The commands are read from README.md's `## A short tour` block, so a README change that breaks
the tour breaks this test. Each runs as written, in order, in one fresh directory (with the
tour's inputs, examples/, copied in), with only size-reducing flags appended (SMALLER): a tiny
model and few steps. Appended flags come last, so where they repeat an option the README gave
(--steps, -e) the smaller value wins; a `--set` the README gives for a field is never
overridden. Slow by nature: about a dozen processes that start jax or torch, two of them jobs
of several ranks (the launch and the torch run), and the sweep's six runs.

The conformance command runs as written, the full suite on torch's 8 gloo ranks, and its table
is checked: every family present and every case passed.
"""
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny import TINY
from xla_env import without_device_count

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # where `trainspec` is installed, for the tour and its ranks


def tour_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## A short tour\n.*?^```bash\n(.*?)^```", text, re.S | re.M)
    assert block, "README.md: no ```bash block under '## A short tour'"
    commands = [shlex.split(line, comments=True) for line in block.group(1).splitlines()]
    return [c for c in commands if c]


def _train_flags(argv: list[str]) -> list[str]:
    """A tiny model (TINY's fields the command does not set itself) and a tenth of its steps."""
    given = {argv[i + 1].split("=")[0] for i, a in enumerate(argv[:-1]) if a == "--set"}
    sets = [a for s in TINY if s.split("=")[0] not in given for a in ("--set", s)]
    steps = int(argv[argv.index("--steps") + 1]) // 10 if "--steps" in argv else 4
    return [*sets, "--steps", str(steps)]


def smaller(argv: list[str]) -> list[str]:
    """The flags appended to one tour command."""
    verb = argv[1:3] if argv[1] == "bench" else argv[1:2]
    if verb == ["train"]:
        return _train_flags(argv)
    if verb == ["launch"]:  # the appended flags go to the command it launches
        return _train_flags(argv[argv.index("--") + 1:])
    return {
        ("bench", "collectives"): ["-e", "4K", "-n", "2", "-w", "1"],
        ("bench", "step"): [*(a for s in TINY for a in ("--set", s)), "--steps", "1",
                            "--warmup", "1"],
        ("sweep",): ["--eval-batches", "1"],
    }.get(tuple(verb), [])


# The conformance table's families (trainspec/core/conformance_runner.py), each a row on rank 0.
FAMILIES = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "permute",
            "special values", "illegal calls", "guarantee levels", "capability table",
            "reference trajectory", "compression bounds", "error feedback", "accumulation",
            "layout invariance", "metric records"}


def check_conformance_table(stdout: str) -> None:
    """Every family ran and passed every case; the total is every layout x dtype of the core's
    cases (697 for torch), not a subset."""
    table = {m[1].strip(): (int(m[2]), int(m[3]), int(m[4])) for m in
             re.finditer(r"\[rank 0\] (\w[\w ]*?)\s+(\d+)\s+(\d+)\s+(\d+)  ", stdout)}
    assert FAMILIES <= set(table), table
    for family, (cases, passed, failed) in table.items():
        assert cases == passed > 0 and failed == 0, (family, table[family])
    assert table["total"][0] >= 600, table["total"]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # of the commands that have ended
    return usage.ru_utime + usage.ru_stime


def test_the_readme_tour_runs_top_to_bottom(tmp_path):
    commands = tour_commands()
    assert all(c[0] == "trainspec" for c in commands), commands
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {k: v for k, v in without_device_count().items() if not k.startswith("TRAINSPEC_")}
    env.update(PATH=f"{BIN}{os.pathsep}{env['PATH']}", TRAINSPEC_CPU_PEAK="table")
    trained = set()  # run dirs a tour command trained: a later one resumes
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; wall s, CPU s:")
    for argv in commands:
        full = [*argv, *smaller(argv)]
        t0, cpu0 = time.monotonic(), _children_cpu_s()
        done = subprocess.run(full, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        print(f"{time.monotonic() - t0:6.1f} {_children_cpu_s() - cpu0:6.1f}  {shlex.join(full)}")
        assert done.returncode == 0, (shlex.join(full), done.stdout[-3000:], done.stderr[-3000:])
        assert "Traceback" not in done.stderr, (shlex.join(full), done.stderr[-3000:])
        assert "is connected to" not in done.stdout  # gloo's per-rank lines: only with -v
        if argv[1] == "conformance":
            check_conformance_table(done.stdout)
            # No rank warns under any layout (FSDP2 x tensor warns of a view unless the adapter
            # filters it: trainspec/torch/train.py)
            assert "Warning:" not in done.stdout + done.stderr, done.stdout[-3000:]
        if argv[1] == "train":
            run_dir = argv[argv.index("--run-dir") + 1] if "--run-dir" in argv else "runs/default"
            assert (run_dir in trained) == ("trainspec: resumed from step" in done.stderr), (
                shlex.join(full), done.stderr[-3000:])
            trained.add(run_dir)
    for output in ("s.json", "report", "busbw.png", "advice.png", "fit.png", "runs/two_hosts",
                   "runs/torch", "runs/ext"):
        assert (tmp_path / output).exists(), output
