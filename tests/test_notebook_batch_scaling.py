"""notebooks/06_batch_size_and_scaling.ipynb runs top to bottom (its asserts check the batch
sweep's direction and that the held-out larger run lands inside the predicted interval)."""
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_batch_size_and_scaling.ipynb"


def test_batch_size_and_scaling_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_flags = os.environ.pop("XLA_FLAGS", None)  # the kernel takes them from its first cell
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if env_flags is not None:
            os.environ["XLA_FLAGS"] = env_flags
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "critical batch B_crit" in outputs and "sweep: S_min" in outputs
    assert "checked: held-out run inside the predicted interval" in outputs
