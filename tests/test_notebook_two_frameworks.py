"""notebooks/05_two_frameworks.ipynb runs top to bottom at its small size (its own asserts check
that both frameworks learn and that the torch adapter passes the conformance table)."""
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "05_two_frameworks.ipynb"


def test_two_frameworks_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={
        "metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "jax" in outputs and "torch" in outputs and "total" in outputs
