"""Every notebook runs top to bottom in a fresh kernel; its own asserts check its claims (05: both
frameworks learn and torch passes the conformance table; 06: the batch sweep's direction and the
held-out run inside the predicted interval), and the text it prints must show what it
demonstrates."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from xla_env import without_device_count

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# Per notebook: text its outputs must contain, and whether it draws a plot.
EXPECTED = {
    "01_quickstart": (["8 devices", "loss"], False),
    "02_collectives": (["8 devices", "# all_reduce", ", 0 wrong elements"], True),
    "03_metrics": (["8 devices", "checked: memory and comm by layout"], True),
    "04_reliability": (["skipped steps = 2", "halt: non-finite", "diverged", "slow steps",
                        "resumed from"], False),
    "05_two_frameworks": (["jax    loss", "torch  loss", "total"], False),
    "06_batch_size_and_scaling": (["critical batch B_crit", "sweep: S_min",
                                   "checked: held-out run inside the predicted interval"], True),
    "07_communication": (["8 devices", "checked: bytes by option"], True),
}


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_executes(name, tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    # A fresh kernel takes its device count from the notebook's first cell, as a reader's would
    # (the suite's other XLA flags kept, tests/xla_env.py).
    monkeypatch.setenv("XLA_FLAGS", without_device_count()["XLA_FLAGS"])
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    expected_text, plots = EXPECTED[name]
    for shown in expected_text:
        assert shown in text, shown
    if plots:
        assert any("image/png" in o.get("data", {}) for o in outputs), "no plot was drawn"
