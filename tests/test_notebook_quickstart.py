"""notebooks/01_quickstart.ipynb runs top to bottom (its own asserts check that it learns)."""
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # A fresh kernel: its XLA_FLAGS come from the notebook's first cell, not from this process.
    env_flags = os.environ.pop("XLA_FLAGS", None)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={
            "metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if env_flags is not None:
            os.environ["XLA_FLAGS"] = env_flags
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "8 devices" in outputs and "loss" in outputs
