"""notebooks/03_metrics.ipynb runs top to bottom (its own asserts check memory and comm by layout)."""
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "03_metrics.ipynb"


def test_metrics_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_flags = os.environ.pop("XLA_FLAGS", None)  # the kernel takes them from its first cell
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if env_flags is not None:
            os.environ["XLA_FLAGS"] = env_flags
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "8 devices" in outputs and "checked: memory and comm by layout" in outputs
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.outputs)
