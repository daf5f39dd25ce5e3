"""What the suite may not leave behind: new files in the repository checkout.

Tests write into their tmp_path and run their processes there. The root conftest lists the
checkout's untracked and ignored entries before the session and after it, and fails the session
naming any new one; build products of the install and of the tools are left out."""
import subprocess
from pathlib import Path

# An install's build tree, Python's and pytest's caches (pytest-benchmark's .benchmarks), CI's
# virtual environments (created while the suite runs beside the other leg), and the `bazel-out`
# link Bazel 4.2.3 puts in the workspace whatever --symlink_prefix says (tests/jax/test_bazel_build.py
# sends the rest of its links to a tmp path).
TOOL_OUTPUTS = ("build/", ".pytest_cache/", ".benchmarks/", ".ci-venv/", ".ci-venv-newest/",
                "bazel-")
TOOL_OUTPUT_PARTS = ("__pycache__/", ".egg-info/")


def checkout_entries(repo: Path) -> set[str] | None:
    """The checkout's untracked and ignored paths (a directory git lists as one entry, such as
    runs/, walked to everything under it), or None where `repo` is not a git checkout or git is
    missing."""
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--ignored", "-z"], cwd=repo,
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    entries = {e[3:] for e in done.stdout.decode(errors="replace").split("\0")
               if e[:2] in ("??", "!!")}
    # git lists no empty directory: the top level's untracked names too (runs/ holding only an
    # empty runs/default/checkpoints)
    tracked = subprocess.run(["git", "ls-tree", "--name-only", "HEAD"], cwd=repo,
                             capture_output=True, text=True, timeout=60).stdout.split()
    entries |= {p.name + "/" if p.is_dir() else p.name for p in repo.iterdir()
                if p.name not in (*tracked, ".git")}
    kept = [e for e in entries if not e.startswith(TOOL_OUTPUTS)
            and not any(part in e for part in TOOL_OUTPUT_PARTS)]
    return {str(p.relative_to(repo)) + ("/" if p.is_dir() else "")
            for entry in kept for p in [repo / entry, *(repo / entry).rglob("*")]
            if not any(part in str(p) for part in TOOL_OUTPUT_PARTS)}


def left_behind(before: set[str] | None, after: set[str] | None) -> list[str]:
    """The entries the session added, sorted ([] when either listing is missing)."""
    if before is None or after is None:
        return []
    return sorted(after - before)
