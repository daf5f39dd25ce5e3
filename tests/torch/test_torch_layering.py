"""The two implementations do not import each other's framework: `trainspec train --framework
torch` runs with jax made unimportable, and the JAX adapter imports with torch made unimportable
(a package of that name on PYTHONPATH that raises ImportError, inherited by every rank)."""
import os
import subprocess
import sys

from cli_runs import run_cli_ok, train_command
from tiny import TINY



def _blocking(tmp_path, name):
    package = tmp_path / "blocked" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise ImportError('{name} is blocked by this test')\n")
    return {**os.environ, "PYTHONPATH": str(package.parent)}


def test_torch_training_imports_no_jax(tmp_path):
    run_cli_ok(train_command(tmp_path / "run", [*TINY, "checkpoint.interval=2"], steps=2,
                             framework="torch", nprocs=2, summary=False),
               env=_blocking(tmp_path, "jax"), timeout=300)
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()


def test_jax_adapter_imports_no_torch(tmp_path):
    code = ("import trainspec.jax.conformance, trainspec.core.conformance_runner, trainspec.jax.train, sys; "
            "assert 'torch' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, env=_blocking(tmp_path, "torch"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
