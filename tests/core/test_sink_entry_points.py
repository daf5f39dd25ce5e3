"""A sink of one's own, through the `trainspec.sinks` entry points: an installed package (here
a .dist-info directory on sys.path, as pip leaves one) registers a factory; `metrics.sinks`
names it and it gets every record the JSONL file gets, its rewind and its close; a name no
package registers is one line naming the field and the names there are."""
import json

import pytest

import hand_records
from tiny import tiny_spec
from trainspec.core.errors import UserInputError
from trainspec.core.sinks import sinks_for

SINK = '''
import json

class ListSink:
    def __init__(self, path, append):
        self.path, self.lines = path, (path.read_text().splitlines() if append else [])
    def write(self, record):
        self.lines.append(json.dumps(record))
    def rewind(self, step):
        self.lines = [l for l in self.lines if json.loads(l)["step"] <= step]
        return {}
    def close(self):
        self.path.write_text("\\n".join(self.lines) + "\\n")

def make(spec, run_dir, append):
    return ListSink(run_dir / "list_sink.jsonl", append)
'''


@pytest.fixture
def installed(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "list_sink-0.1.dist-info").mkdir(parents=True)
    (site / "list_sink-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: list-sink\nVersion: 0.1\n")
    (site / "list_sink-0.1.dist-info" / "entry_points.txt").write_text(
        "[trainspec.sinks]\nlisted = list_sink:make\n")
    (site / "list_sink.py").write_text(SINK)
    monkeypatch.syspath_prepend(str(site))


def _record(step):
    return hand_records.record(step, loss=5.0 - step)


def test_a_registered_sink_gets_every_record(installed, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    sinks = sinks_for(tiny_spec('metrics.sinks=["listed"]'), run, writer=True)
    assert [type(s).__name__ for s in sinks] == ["JsonlWriter", "ListSink"]
    for step in (1, 2, 3):
        for sink in sinks:
            sink.write(_record(step))
    for sink in sinks:
        sink.rewind(2)  # a resume from step 2: step 3 is redone
        sink.write(_record(3))
        sink.close()
    listed, jsonl = ([json.loads(line) for line in (run / name).read_text().splitlines()]
                     for name in ("list_sink.jsonl", "metrics.jsonl"))
    assert listed == jsonl and [r["step"] for r in listed] == [1, 2, 3]
    assert sinks_for(tiny_spec('metrics.sinks=["listed"]'), run, writer=False) == []


def test_an_unregistered_sink_is_one_line(installed, tmp_path):
    with pytest.raises(UserInputError) as err:
        sinks_for(tiny_spec('metrics.sinks=["neptune"]'), tmp_path, writer=True)
    assert str(err.value) == ("metrics.sinks: no sink 'neptune' is installed (registered under "
                              "the trainspec.sinks entry points: listed, mlflow, wandb)")
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any file is opened
