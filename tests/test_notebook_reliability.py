"""notebooks/04_reliability.ipynb runs top to bottom; its asserts check that each guard fired."""
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "04_reliability.ipynb"


def test_reliability_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_flags = os.environ.pop("XLA_FLAGS", None)  # the notebook's first cell sets its own
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={
            "metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    finally:
        if env_flags is not None:
            os.environ["XLA_FLAGS"] = env_flags
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    for caught in ("skipped steps = 2", "halt: non-finite", "diverged", "slow steps", "resumed from"):
        assert caught in outputs
