"""Docs describe the system, not its history: no commit hashes, issue numbers or "before this
work" passages in any of them, and measurements (a date or clock time, a load average, the
machine a number was taken on) only in docs/results.md, where each section says where, when
and how to take it again."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results.md"
DOCS = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"])

# 7 to 40 hex digits with at least one letter and one digit (a short or full commit hash)
COMMIT = re.compile(r"(?<!\.)\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
# a clock time: HH:MM followed by a range or UTC, or UTC itself (not `--at 31:47`, a step range)
CLOCK = re.compile(r"\b\d{1,2}:\d\d(?=[–-]\d{1,2}:\d\d| UTC)|\bUTC\b")
ISSUE = re.compile(r"\bissues? #?\d+|(?<![\w&])#\d{2,}\b", re.I)
HISTORY = re.compile(r"before this work|this revision|previous handlers|first implementation|"
                     r"by the integrator|first draft|not done yet|before the single runner|"
                     r"\bwe tried\b|\bbefore the fix\b", re.I)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# a load with its value ("load 8", "load average ~7", "loaded it (load average 9.7"), not the
# words alone: a bench prints "the load average" as one of its columns
LOAD = re.compile(r"\bload(?: averages?)? (?:of |at |was |were |up to |~)?\d", re.I)
MACHINE = re.compile(r"\bEPYC\b|\bXeon\b|\bVM\b")


def history(text: str) -> list[str]:
    """What in `text` narrates how the code got here rather than what it is: a commit, an issue,
    a passage about an earlier state."""
    return [m.group(0) for pattern in (COMMIT, ISSUE, HISTORY)
            for m in pattern.finditer(text) if not _cites_another_project(text, m)]


def _cites_another_project(text: str, match: re.Match) -> bool:
    """An issue of another repository ("NVIDIA/Megatron-LM issue 756") is a source, not ours."""
    return match.re is ISSUE and re.search(r"\b[\w.-]+/[\w.-]+ $", text[:match.start()]) is not None


def measurement_log(text: str) -> list[str]:
    """What in `text` belongs to a measurement: its date and time, the machine's load, the
    machine."""
    return [m.group(0) for pattern in (DATE, CLOCK, LOAD, MACHINE) for m in pattern.finditer(text)]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_a_doc_names_no_commit_issue_or_history(doc):
    assert history(doc.read_text()) == []


@pytest.mark.parametrize("doc", [d for d in DOCS if d != RESULTS], ids=_name)
def test_measurements_live_only_in_the_results_page(doc):
    found = [(i, line) for i, line in enumerate(doc.read_text().splitlines(), 1)
             if measurement_log(line)]
    assert found == [], f"{_name(doc)}: move these to docs/results.md: {found}"


def test_each_result_says_where_when_and_how_to_take_it_again():
    sections = re.split(r"^## ", RESULTS.read_text(), flags=re.M)[1:]
    assert len(sections) >= 5
    for section in sections:
        title = section.splitlines()[0]
        assert DATE.search(section), f"results.md, {title}: no date"
        assert MACHINE.search(section) or "2-core" in section, f"results.md, {title}: no machine"
        assert re.search(r"^ {4}\S|`(python|trainspec|pytest|bench/)[^`]*`", section, re.M), (
            f"results.md, {title}: no command to take it again")


def test_the_checks_can_fail():
    assert history("fixed in 3ae91ef (issue 36); before this work we tried") == [
        "3ae91ef", "issue 36", "before this work", "we tried"]
    assert measurement_log("AMD EPYC VM, 2026-12-05 05:40 UTC, load average 9; at load ~8") == [
        "2026-12-05", "05:40", "UTC", "load average 9", "load ~8", "EPYC", "VM"]
    assert history("1.2095e10 FLOPs, `--at 31:47` (docs/spec.md §2)") == []
    assert history("16 H100 (NVIDIA/Megatron-LM issue 756)") == []
    assert measurement_log("the step loads the batch; the bench prints the load average") == []
