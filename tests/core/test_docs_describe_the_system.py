"""Docs describe the system, not its history: no commit hashes, clock times or "before this
work" passages, and every measurement's date in one table per document (where the machines
are named too), so that a number keeps where and when it was taken without the prose
narrating how the code got there."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/collectives.md", "docs/xla_ext.md", "docs/plan.md"]

# 7 to 40 hex digits with at least one letter and one digit (a short or full commit hash)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
CLOCK = re.compile(r"\b\d{1,2}:\d\d\b|\bUTC\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HISTORY = ("before this work", "this revision", "previous handlers", "first implementation",
           "by the integrator", "first draft", "not done yet", "before the single runner")


@pytest.mark.parametrize("name", DOCS)
def test_a_doc_names_no_commit_clock_time_or_history(name):
    text = (ROOT / name).read_text()
    assert not COMMIT.findall(text), COMMIT.findall(text)
    assert not CLOCK.findall(text), CLOCK.findall(text)
    assert [h for h in HISTORY if h in text.lower()] == []


@pytest.mark.parametrize("name", DOCS)
def test_a_docs_measurement_dates_are_in_one_table(name):
    lines = (ROOT / name).read_text().splitlines()
    dated = [i for i, line in enumerate(lines) if DATE.search(line)]
    assert dated, f"{name}: its measurements carry no date"
    first, last = dated[0], dated[-1]
    assert all(lines[i].startswith("|") for i in range(first, last + 1)), (
        f"{name}: dates outside one table, lines {[i + 1 for i in dated]}")
