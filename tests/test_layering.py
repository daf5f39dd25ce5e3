"""The import-linter contracts of pyproject.toml hold: imports only point down the layers, and
spec_jax.core imports no framework. `lint-imports` is run as a user would run it."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache"]


def _lint(*args):
    return subprocess.run([*LINT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    done = _lint()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    for contract in ("Imports only point down the layers", "The core imports no framework"):
        assert f"{contract} KEPT" in done.stdout, done.stdout[-3000:]


def test_a_broken_contract_fails(tmp_path):
    """The check can fail: with the layers turned upside down, every downward import breaks."""
    config = tmp_path / "upside_down.toml"
    config.write_text('[tool.importlinter]\nroot_package = "spec_jax"\n\n'
                      '[[tool.importlinter.contracts]]\nname = "upside down"\ntype = "layers"\n'
                      'containers = ["spec_jax"]\nlayers = ["core", "step"]\n')
    done = _lint("--config", str(config))
    assert done.returncode != 0
    assert "spec_jax.step is not allowed to import spec_jax.core" in done.stdout
