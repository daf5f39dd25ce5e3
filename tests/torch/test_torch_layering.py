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


def test_the_command_starting_the_ranks_imports_torch_only_where_a_gpu_could_be(tmp_path):
    """The checks `trainspec train --framework torch --nprocs N` runs before starting its ranks
    (the reference model's host memory, the default rank count) ask whether a rank has a GPU:
    a CPU-only torch build (`+cpu`) answers from its version, without `import torch`."""
    code = ("import sys; from importlib.metadata import version; "
            "from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec; "
            "from trainspec.torch.backend import BACKEND, default_ranks; "
            "BACKEND.check_model(load_spec(DEFAULT_SPEC_PATH), None); default_ranks(); "
            "assert ('torch' in sys.modules) != version('torch').endswith('+cpu'), version('torch')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
