"""Each metrics record reaches the file whole or not at all (trainspec.core.records.JsonlWriter):
a write the file system refuses or cuts short (a full disk) leaves the records before it."""
import errno
import json
import os

import pytest

from trainspec.core import records


def _record(step):
    return {"step": step, "loss": 1.0 / step, "note": "x" * 100}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("failure", ["enospc", "short"])
def test_a_failed_write_leaves_only_whole_records(tmp_path, monkeypatch, failure):
    path = tmp_path / "metrics.jsonl"
    writer = records.JsonlWriter(path)
    writer.write(_record(1))
    real_write = os.write

    def full_disk(fd, data):
        if failure == "enospc":  # some of it may be on disk before the error: write half
            real_write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(records.os, "write", full_disk)
    with pytest.raises(OSError) as err:
        writer.write(_record(2))
    assert err.value.errno == errno.ENOSPC
    assert _lines(path) == [_record(1)]  # no torn line: the half written was cut back
    monkeypatch.setattr(records.os, "write", real_write)
    writer.write(_record(3))  # space again: appended after the whole ones
    writer.close()
    assert _lines(path) == [_record(1), _record(3)]


def test_each_record_is_one_write_of_its_whole_line(tmp_path, monkeypatch):
    """One write per record: nothing buffered that could reach the file in pieces."""
    path = tmp_path / "metrics.jsonl"
    writes = []
    real_write = os.write
    monkeypatch.setattr(records.os, "write",
                        lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    writer = records.JsonlWriter(path)
    writer.write(_record(1))
    writer.write(_record(2))
    writer.close()
    assert writes == [path.read_bytes()[: len(writes[0])], path.read_bytes()[len(writes[0]):]]
    assert all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)


def test_a_rewound_file_is_appended_at_its_new_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = records.JsonlWriter(path)
    for step in (1, 2, 3):
        writer.write(_record(step))
    writer.rewind(1)
    writer.write(_record(2))
    writer.close()
    assert [r["step"] for r in _lines(path)] == [1, 2]
    again = records.JsonlWriter(path, append=True)  # a resume keeps them
    again.write(_record(3))
    again.close()
    assert [r["step"] for r in _lines(path)] == [1, 2, 3]
    records.JsonlWriter(path).close()  # a new run starts empty
    assert path.read_text() == ""


def test_aux_leaves_are_recorded_by_path():
    """A user's aux pytree (host values at the record) becomes {path: number}: nested names
    joined by '/', list items by index, non-finite as null, arrays of many elements left out."""
    import numpy as np

    from trainspec.core.recorder import aux_fields

    tree = {"acc": np.float32(0.5), "parts": [np.float32(1.0), {"n": 3}],
            "bad": np.float32("nan"), "vector": np.ones(4)}
    assert aux_fields(tree) == {"acc": 0.5, "parts/0": 1.0, "parts/1/n": 3.0, "bad": None}
