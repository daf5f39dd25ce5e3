"""The two implementations do not import each other's framework: `trainspec train --framework
torch` runs with jax made unimportable, and the JAX adapter imports with torch made unimportable
(a package of that name on PYTHONPATH that raises ImportError, inherited by every rank)."""
import os
import subprocess
import sys
from pathlib import Path

from tiny import TINY

ROOT = Path(__file__).resolve().parents[2]


def _blocking(tmp_path, name):
    package = tmp_path / "blocked" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise ImportError('{name} is blocked by this test')\n")
    return {**os.environ, "PYTHONPATH": str(package.parent)}


def test_torch_training_imports_no_jax(tmp_path):
    spec = [*TINY, "checkpoint.interval=2"]
    sets = [a for s in spec for a in ("--set", s)]
    result = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "train", "--framework", "torch", "--nprocs", "2",
         "--quiet", "--steps", "2", "--run-dir", str(tmp_path / "run"), *sets],
        capture_output=True, text=True, cwd=ROOT, env=_blocking(tmp_path, "jax"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()


def test_jax_adapter_imports_no_torch(tmp_path):
    code = ("import trainspec.jax.adapter, trainspec.core.conformance_runner, trainspec.jax.train, sys; "
            "assert 'torch' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, env=_blocking(tmp_path, "torch"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
