"""The import-linter contracts of pyproject.toml hold: the trunk's layers (cli above the two
backends, neither importing the other nor the CLI, above report and core), the JAX backend's own
layers, no framework and no backend in trainspec.core, no import cycle in the torch backend. `lint-imports` is run as a user would run it."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache"]


def _lint(*args):
    return subprocess.run([*LINT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    done = _lint()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    for contract in ("One trunk: cli above the implementations",
                     "Inside the JAX implementation, imports only point down the layers",
                     "The core and the reports import no framework",
                     "The torch implementation imports no jax",
                     "The core imports no backend and no CLI",
                     "No backend imports another backend",
                     "No backend imports the CLI",
                     "The torch backend has no import cycle"):
        assert contract in done.stdout, done.stdout[-3000:]
    assert "0 broken" in done.stdout, done.stdout[-3000:]


def test_a_broken_contract_fails(tmp_path):
    """The check can fail: with the layers turned upside down, every downward import breaks."""
    config = tmp_path / "upside_down.toml"
    config.write_text('[tool.importlinter]\nroot_package = "trainspec"\n\n'
                      '[[tool.importlinter.contracts]]\nname = "upside down"\ntype = "layers"\n'
                      'containers = ["trainspec"]\nlayers = ["core", "jax"]\n')
    done = _lint("--config", str(config))
    assert done.returncode != 0
    assert "trainspec.jax is not allowed to import trainspec.core" in done.stdout
