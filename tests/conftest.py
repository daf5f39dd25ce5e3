"""Test setup: 8 simulated CPU devices, set before anything imports jax."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# MFU on a CPU divides by the table's peak rather than this machine's measured one: no
# measurement (about a second, and load-dependent) in every test process and subprocess.
# tests/test_cpu_peak.py measures and caches with its own cache directory.
os.environ.setdefault("TRAINSPEC_CPU_PEAK", "table")
# Subprocesses (`python -m spec_jax.cli.main ...`, launched ranks, notebook kernels) run from the
# repository root: without this, Python would put the root first on sys.path and import the
# source tree's spec_jax, which has no compiled _xla_ext, instead of the installed package.
os.environ["PYTHONSAFEPATH"] = "1"

import jax  # noqa: E402  (must come after XLA_FLAGS)

assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"
