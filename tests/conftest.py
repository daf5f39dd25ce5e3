"""Test setup: 8 simulated CPU devices, set before anything imports jax."""
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The helpers every folder's tests share (tiny, run_dirs, xla_env, metrics_jobs) live here, in
# tests/; a folder's own helpers live beside its tests (pytest puts a test file's folder on
# sys.path). Explicit, so that they import under any --import-mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkout_guard import checkout_entries, left_behind  # noqa: E402
from xla_env import speed_flags  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
_CHECKOUT_BEFORE = pytest.StashKey()

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *speed_flags(), "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile without most of XLA's backend optimisation (jax's switch: LLVM at -O0, no expensive
# passes); every subprocess and notebook kernel inherits it. On 2 cores the suite's time is mostly
# XLA compiling small programs, not running them, and this cuts that by about a third
# (docs/results.md, "The test suite's time"). The generated code runs slower and may round
# differently in the last bit (LLVM's default level can fuse a multiply and an add into one
# FMA), so every process of a test run compiles the same way and bitwise comparisons still
# compare like with like.
# Outside the suite nothing sets it: the README's commands and the benchmarks, as a user runs
# them, compile at XLA's default. Files marked `optimised` (below) compile at the default too.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# MFU on a CPU divides by the table's peak rather than this machine's measured one: no
# measurement (about a second, and load-dependent) in every test process and subprocess.
# tests/core/test_cpu_peak.py measures and caches with its own cache directory.
os.environ.setdefault("TRAINSPEC_CPU_PEAK", "table")
# Subprocesses (`python -m trainspec.cli.main ...`, launched ranks, notebook kernels) run from the
# repository root: without this, Python would put the root first on sys.path and import the
# source tree's trainspec.jax, which has no compiled _xla_ext, instead of the installed package.
os.environ["PYTHONSAFEPATH"] = "1"

# One compilation cache per test run, shared by the xdist workers and every subprocess they
# start: the suite compiles the same tiny programs many times over (each kill -9 test trains,
# kills and resumes the same job in fresh processes; the README tour and notebooks start a
# dozen). A fresh directory per run keeps runs independent of each other.
# The first process to get here (pytest's controller, or the only process with -n 0) makes it;
# the workers it starts inherit it, and it removes it at the end.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="trainspec-tests-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (must come after XLA_FLAGS)

assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"


def _controller(config) -> bool:
    """pytest's own process, not one of its xdist workers."""
    return not hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if _controller(session.config):
        session.config.stash[_CHECKOUT_BEFORE] = checkout_entries(REPO)


def pytest_sessionfinish(session):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    if not _controller(session.config):
        return
    new = left_behind(session.config.stash.get(_CHECKOUT_BEFORE, None), checkout_entries(REPO))
    if new:  # a test wrote into the checkout rather than its tmp_path: the session fails
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = f"the tests left new files in the checkout {REPO}: {', '.join(new)}"
        if reporter:
            reporter.write_line(line, red=True)
        else:
            print(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(items):
    # The slow files first, in their collection order: with --no-loadscope-reorder xdist hands
    # files to the workers in this order, so the last files to start are short ones.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="module", autouse=True)
def _optimised_compiles(request):
    # A file marked `optimised` runs its programs long enough (the default model, hundreds of
    # steps in all) that XLA's default optimisation repays its compile time: it compiles at the
    # default (docs/results.md, "The test suite's time").
    if request.node.get_closest_marker("optimised") is None:
        yield
        return
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)
