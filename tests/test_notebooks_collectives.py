"""notebooks/02_collectives.ipynb runs top to bottom: benchmark, plot, and its #wrong == 0 check."""
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "02_collectives.ipynb"


def test_collectives_notebook_executes(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # A fresh kernel: its device count must come from the notebook's first cell, not from us.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    assert "8 devices" in text and "# all_reduce" in text and ", 0 wrong elements" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot was drawn"
