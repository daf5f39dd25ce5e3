"""The TensorBoard sink: tags grouped loss/ perf/ memory/ comm/, the spec once as text, the
step's constant facts as text (and memory/comm sizes once per layout), wall time not logged."""
import json
import struct

import pytest

from tiny import tiny_spec
from trainspec.core.records import FIELDS, MARKS
from trainspec.core import sinks
from trainspec.core.sinks import TensorBoardSink


def _record(step, **changes):
    """A record with every field of the format, as the logger writes it."""
    record = {
        "schema": "trainspec.metrics/1", "step": step, "steps_in_interval": 2, "time": 1.7e9 + step,
        "loss": 5.0 - 0.1 * step, "grad_norm": 1.5, "learning_rate": 1e-4 * step,
        "step_time_s": 0.1, "tokens_per_s": 1000.0 + step, "padded_tokens_per_s": 1100.0,
        "model_flops_per_step": 1e9, "flops_convention": "no_causal_discount",
        "hardware_flops_per_step": 1.1e9, "xla_flops_per_step": 1.2e9, "mfu": 0.01, "hfu": 0.011,
        "peak_flops_per_device": 1.8e10, "peak_flops_source": "table:cpu", "n_devices": 8,
        **{f"memory_{k}_bytes": 1000 for k in ("peak", "argument", "output", "alias", "temp",
                                               "generated_code", "xla_peak")},
        "memory_live_bytes": None, "comm_bytes_per_step": 4096.0, "comm_bus_bytes_per_step": 7168.0,
        "comm_bytes_by_kind": {"all-reduce": 4096.0}, "comm_bytes_by_axis": {"data": 4096.0},
        "data_wait_s": 0.01, "data_wait_fraction": 0.05, "compile_time_s": 3.0, "elapsed_s": 9.0 + step,
        "goodput": 0.5, "badput_s": {"compilation": 3.0, "other": 0.5}, "batch_tokens": 256,
        "gns_source": None, "gns_grad_sq": None, "gns_trace": None, "gns": None,
    }
    return {**record, **changes}


class FakeWriter:
    def __init__(self, logdir):
        self.scalars, self.texts = [], []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))

    def close(self):
        pass


def _write(writer_class, logdir, records, monkeypatch):
    monkeypatch.setattr(sinks, "_summary_writer_class", lambda: writer_class)
    sink = TensorBoardSink(logdir, tiny_spec())
    for record in records:
        sink.write(record)
    sink.close()
    return sink


# The second layout (a resume onto another mesh) changes the comm volume and the peak.
RECORDS = [_record(1), _record(2), _record(4),
           _record(6, comm_bytes_per_step=2048.0, comm_bytes_by_axis={"data": 2048.0},
                   n_devices=4, resumed_from_step=4, resumed_from_mesh="data=8")]


def test_every_record_field_has_a_place():
    placed = [*sinks.PER_RECORD, *sinks.PER_LAYOUT, *sinks.AS_TEXT, *sinks.NOT_LOGGED]
    assert len(placed) == len(set(placed))
    assert {*FIELDS, *MARKS} <= set(placed), {*FIELDS, *MARKS} - set(placed)


def test_scalars_are_grouped_and_constants_are_not_repeated(tmp_path, monkeypatch):
    writer = _write(FakeWriter, tmp_path, RECORDS, monkeypatch)._writer
    tags = {tag for tag, _, _ in writer.scalars}
    assert {t.split("/")[0] for t in tags} == {"loss", "perf", "memory", "comm"}
    assert {"loss/loss", "loss/learning_rate", "perf/tokens_per_s", "perf/badput_s/compilation",
            "memory/peak_bytes", "comm/bytes_per_step", "comm/bytes_by_axis/data"} <= tags
    # Wall time, bookkeeping and the run's constants are not scalars.
    for absent in ("time", "elapsed_s", "n_devices", "peak_flops_per_device", "compile_time_s"):
        assert not any(t.split("/")[-1] == absent for t in tags), absent
    steps_of = lambda tag: [s for t, _, s in writer.scalars if t == tag]  # noqa: E731
    assert steps_of("loss/loss") == [1, 2, 4, 6]
    assert steps_of("comm/bytes_per_step") == [1, 6]  # once per layout: at start, after resume
    assert [v for t, v, _ in writer.scalars if t == "comm/bytes_per_step"] == [4096.0, 2048.0]
    assert not any(t == "memory/live_bytes" for t in tags)  # null (CPU) is not a point
    # The spec once; the facts whenever they change, naming the resume.
    assert [(t, s) for t, _, s in writer.texts] == [("spec", 1), ("facts", 1), ("facts", 6)]
    spec_text = writer.texts[0][1]
    assert json.loads(spec_text.strip("`\n"))["model"]["d_model"] == 32
    assert "- n_devices: `4`" in writer.texts[2][1] and "resumed_from_step: `4`" in writer.texts[2][1]


def test_an_unknown_numeric_field_is_kept_under_other(tmp_path, monkeypatch):
    writer = _write(FakeWriter, tmp_path, [_record(1, new_counter=3, note="x")], monkeypatch)._writer
    assert ("other/new_counter", 3, 1) in writer.scalars
    assert not any("note" in t for t, _, _ in writer.scalars)


def _events(logdir):
    """Events of the TFRecord files under `logdir`: u64 length, u32 crc, data, u32 crc."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[offset + 12:offset + 12 + length])
            events.append(event)
            offset += 12 + length + 4
    return events


def test_real_event_file_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("tensorboardX")
    _write(sinks._summary_writer_class(), tmp_path, RECORDS, monkeypatch)
    scalars, texts = {}, {}
    for event in _events(tmp_path):
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "text":
                texts.setdefault(value.tag.split("/")[0], []).append(event.step)
            else:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    assert scalars["loss/loss"] == [(1, pytest.approx(4.9)), (2, pytest.approx(4.8)),
                                    (4, pytest.approx(4.6)), (6, pytest.approx(4.4))]
    assert scalars["comm/bytes_per_step"] == [(1, 4096.0), (6, 2048.0)]
    assert {t.split("/")[0] for t in scalars} == {"loss", "perf", "memory", "comm"}
    assert texts == {"spec": [1], "facts": [1, 6]}
