"""The notebooks ship executed, and what they show is what they do now.

Each notebook runs top to bottom once, in a fresh kernel started in notebooks/ as a reader's
would be. That one run checks: the notebook's own asserts (05: both frameworks learn; 06: the
batch sweep's direction and the held-out run inside the predicted interval); the text that must
show what it demonstrates; that it wrote nothing into notebooks/; and that the outputs stored
in the file are current: every number it shows through trainspec/report/claims.py repeats within
the tolerance its code states, and every stored figure is drawn again.

After an API change, re-execute and store them all (or some, with -k):
    STORE_NOTEBOOKS=1 python -m pytest -n 0 tests/cli/test_notebooks.py -k executes
"""
import copy
import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from trainspec.report import claims
from xla_env import without_device_count

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
STORE = os.environ.get("STORE_NOTEBOOKS") == "1"
# Per notebook: text its outputs must contain, and whether it draws a plot.
EXPECTED = {
    "01_quickstart": (["8 devices", "loss"], False),
    "02_collectives": (["8 devices", "# all_reduce", ", 0 wrong elements"], True),
    "03_metrics": (["8 devices", "checked: memory and comm by layout"], True),
    "04_reliability": (["rollback: loss spike", "skipped steps = 2", "halt: non-finite",
                        "diverged", "slow steps", "resumed from"], False),
    "05_two_frameworks": (["jax    loss", "torch  loss"], True),
    "06_batch_size_and_scaling": (["critical batch B_crit", "sweep: S_min",
                                   "checked: held-out run inside the predicted interval"], True),
    "07_communication": (["8 devices", "checked: bytes by option"], True),
}


def claims_shown(nb) -> list[tuple[int, dict, str]]:
    """(cell index, record, shown line) of every claim in the notebook's outputs, in order."""
    return [(i, out.metadata[claims.METADATA_KEY], out.data["text/plain"])
            for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for out in cell.outputs if claims.METADATA_KEY in out.get("metadata", {})]


def figures_drawn(nb) -> dict[int, int]:
    """Cell index -> number of figures among its outputs."""
    counts = {i: sum("image/png" in out.get("data", {}) for out in cell.outputs)
              for i, cell in enumerate(nb.cells) if cell.cell_type == "code"}
    return {i: n for i, n in counts.items() if n}


def agree(stored, fresh, rtol: float, atol: float) -> bool:
    numbers = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in (stored, fresh)]
    if all(numbers):
        return abs(fresh - stored) <= atol + rtol * abs(stored)
    if isinstance(stored, list) and isinstance(fresh, list):
        return len(stored) == len(fresh) and all(
            agree(s, f, rtol, atol) for s, f in zip(stored, fresh))
    if isinstance(stored, dict) and isinstance(fresh, dict):
        return stored.keys() == fresh.keys() and all(
            agree(stored[k], fresh[k], rtol, atol) for k in stored)
    return stored == fresh


def stale(name: str, stored, fresh) -> list[str]:
    """What the stored notebook shows that its fresh execution does not: one line each."""
    problems = []
    stored_claims, fresh_claims = claims_shown(stored), claims_shown(fresh)
    for i, record, text in stored_claims:
        if text != claims.render(record):
            problems.append(f"{name} cell {i}: shows {text!r}, but its stored values give "
                            f"{claims.render(record)!r} (edited by hand?)")
    templates = [r["template"] for _, r, _ in stored_claims]
    if templates != [r["template"] for _, r, _ in fresh_claims]:
        problems.append(f"{name}: stored claims {templates} are not the ones it shows now "
                        f"{[r['template'] for _, r, _ in fresh_claims]}")
    else:
        for (i, old, text), (_, new, _) in zip(stored_claims, fresh_claims):
            for key, value in old["values"].items():
                if key in new["timing"]:
                    continue
                if not agree(value, new["values"][key], new["rtol"], new["atol"]):
                    problems.append(
                        f"{name} cell {i}: {key} = {value!r} stored ({text!r}), now "
                        f"{new['values'][key]!r} (rtol {new['rtol']}, atol {new['atol']})")
    if figures_drawn(stored) != figures_drawn(fresh):
        problems.append(f"{name}: figures by cell stored {figures_drawn(stored)}, "
                        f"drawn now {figures_drawn(fresh)}")
    unstored = [i for i, (old, new) in enumerate(zip(stored.cells, fresh.cells))
                if new.cell_type == "code" and new.outputs and not old.outputs]
    if unstored:
        problems.append(f"{name}: cells {unstored} show output that is not stored")
    return problems


def _listing() -> set[Path]:
    return set(NOTEBOOKS.rglob("*"))


def _store(nb, path: Path):
    """Write the executed notebook without what changes from run to run but its results."""
    nb.metadata = nbformat.NotebookNode(kernelspec=nb.metadata.kernelspec)  # no language_info
    partial = path.with_suffix(".partial")
    nbformat.write(nb, partial)
    os.replace(partial, path)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_executes(name, monkeypatch):
    path = NOTEBOOKS / f"{name}.ipynb"
    stored = nbformat.read(path, as_version=4)
    fresh = copy.deepcopy(stored)
    # A fresh kernel takes its device count from the notebook's first cell, as a reader's would
    # (the suite's other XLA flags kept, tests/xla_env.py).
    monkeypatch.setenv("XLA_FLAGS", without_device_count()["XLA_FLAGS"])
    before = _listing()
    NotebookClient(fresh, timeout=900, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    written = sorted(str(p.relative_to(NOTEBOOKS)) for p in _listing() - before)
    assert not written, f"{name} wrote into notebooks/: {written}"

    outputs = [o for c in fresh.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    expected_text, plots = EXPECTED[name]
    for shown in expected_text:
        assert shown in text, shown
    if plots:
        assert any("image/png" in o.get("data", {}) for o in outputs), "no plot was drawn"
    assert claims_shown(fresh), f"{name} shows no number through claims.claim"
    if STORE:
        _store(fresh, path)
    else:
        problems = stale(name, stored, fresh)
        assert not problems, ("stored outputs are stale (STORE_NOTEBOOKS=1 stores them):\n"
                              + "\n".join(problems))


def _stored(name: str):
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_is_stored_executed(name):
    nb = _stored(name)
    assert claims_shown(nb), f"{name} is stored without its outputs"
    assert stale(name, nb, nb) == []
    assert bool(figures_drawn(nb)) == EXPECTED[name][1], f"{name}: figures stored"
    # Nothing that differs from run to run but the results: no timings, no kernel's versions.
    assert set(nb.metadata) == {"kernelspec"}, f"{name}: store it with STORE_NOTEBOOKS=1"
    assert not [c for c in nb.cells if "execution" in c.metadata], f"{name}: timings stored"


def _edited_copy(name: str, tmp_path: Path, edit) -> tuple[list[str], str]:
    """Apply `edit(file text, record, key)` at the notebook's first compared number (a float, not
    a timing), read the edited copy back, and check it against the stored notebook standing in
    for a fresh run that repeats it; returns the problems and the number's name."""
    nb = _stored(name)
    record, key = next((r, k) for _, r, _ in claims_shown(nb) for k, v in r["values"].items()
                       if isinstance(v, float) and k not in r["timing"])
    copy_path = tmp_path / f"{name}.ipynb"
    copy_path.write_text(edit((NOTEBOOKS / f"{name}.ipynb").read_text(), record, key))
    return stale(name, nbformat.read(copy_path, as_version=4), nb), key


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def test_an_edited_stored_number_is_reported(tmp_path):
    def edit(text, record, key):  # the number and the line showing it, as a consistent hand edit
        changed = {**record, "values": {**record["values"], key: record["values"][key] * 1.01}}
        text = _replace_once(text, f'"{key}": {json.dumps(record["values"][key])}',
                             f'"{key}": {json.dumps(changed["values"][key])}')
        return _replace_once(text, json.dumps(claims.render(record)),
                             json.dumps(claims.render(changed)))

    problems, key = _edited_copy("01_quickstart", tmp_path, edit)
    assert len(problems) == 1, problems
    assert problems[0].startswith("01_quickstart cell ") and f"{key} = " in problems[0], problems


def test_an_edited_shown_line_is_reported(tmp_path):
    def edit(text, record, key):  # one digit of the visible line, its stored values left alone
        line = claims.render(record)
        digit = next(c for c in line if c.isdigit())
        return _replace_once(text, json.dumps(line),
                             json.dumps(line.replace(digit, str((int(digit) + 1) % 10), 1)))

    problems, _ = _edited_copy("01_quickstart", tmp_path, edit)
    assert len(problems) == 1, problems
    assert problems[0].startswith("01_quickstart cell ") and "edited by hand" in problems[0]


def test_a_timing_is_shown_but_not_compared():
    stored = _stored("05_two_frameworks")
    fresh = copy.deepcopy(stored)  # as a run on a machine twice as fast would show it
    timings = [(record, key) for _, record, _ in claims_shown(fresh) for key in record["timing"]]
    assert timings, "05_two_frameworks shows tokens/s as a timing"
    for record, key in timings:
        record["values"][key] *= 2
    assert stale("05_two_frameworks", stored, fresh) == []
