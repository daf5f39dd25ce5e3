"""`trainspec report` compares runs that differ: the spec fields that differ (from each run
directory's spec.toml), throughput per device beside totals (an 8-device run beside a 4-rank
run), curves of the gradient norm and of the GNS with its 90% interval, and an x-axis by tokens
trained. Records are written by hand here: what is drawn and tabulated follows from them."""
import json
import re

import pytest

import hand_records
from trainspec.cli.main import main
from trainspec.core.records import read_jsonl
from trainspec.core.run_files import save_spec
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.report import page as report_page, plots


def _record(step: int, **fields) -> dict:
    return hand_records.record(step, **{
        "steps_in_interval": 2, "time": 0.0, "loss": 5.0 - 0.1 * step, "grad_norm": 1.0 / step,
        "step_time_s": 0.5, "tokens_per_s": 800.0, "n_devices": 8, "batch_tokens": 1024,
        "comm_bytes_by_kind": {}, "comm_bytes_by_axis": {}, "flops_convention": "6N",
        "peak_flops_source": "test", **fields})


def _run(run_dir, overrides=None, steps=(2, 4, 6), **fields):
    """A run directory: records at `steps` (2 steps each) and, unless `overrides` is None, the
    spec.toml `trainspec train` leaves beside them."""
    run_dir.mkdir(parents=True)
    lines = [json.dumps(_record(s, **fields)) for s in steps]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if overrides is not None:
        save_spec(load_spec(DEFAULT_SPEC_PATH, overrides), run_dir)
    return run_dir


def test_the_spec_fields_that_differ_are_tabulated(tmp_path, capsys):
    a = _run(tmp_path / "a", ["batch.micro_batch=8"])
    b = _run(tmp_path / "b", ["batch.micro_batch=16", "mesh.axes.fsdp.size=2"])
    loose = _run(tmp_path / "loose")  # a metrics file without its spec
    out = tmp_path / "report"
    assert main(["report", str(a), str(b), str(loose), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    diff = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.startswith(("batch.", "mesh.", "model.", "spec field"))}
    assert diff == {"spec": ["field", "a", "b", "loose"], "batch.micro_batch": ["8", "16", "-"],
                    "mesh.axes.fsdp.size": ["1", "2", "-"]}, text
    assert "loose: no spec.toml beside its records: its spec is not compared" in text
    html = (out / "index.html").read_text()
    assert "<h2>Spec fields that differ</h2>" in html
    assert "<tr><td>batch.micro_batch</td><td>8</td><td>16</td><td>-</td></tr>" in html


def test_specs_that_agree_say_so_in_one_line(tmp_path, capsys):
    runs = [_run(tmp_path / name, []) for name in ("a", "b")]
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "r")]) == 0
    assert "spec: the runs' specs agree on every field" in capsys.readouterr().out


def test_the_ratio_rows_compare_throughput_per_device(tmp_path, capsys):
    eight = _run(tmp_path / "eight", n_devices=8, tokens_per_s=800.0)
    four = _run(tmp_path / "four", n_devices=4, tokens_per_s=600.0)
    assert main(["report", str(eight), str(four), "--out", str(tmp_path / "r")]) == 0
    table = capsys.readouterr().out
    cells = [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()]
    row = {c[0]: c[1:] for c in cells if c[0].startswith(("devices", "tokens/s"))}
    assert row["devices"] == ["8", "4", "0.500x"]
    assert row["tokens/s (median)"] == ["800", "600", "0.750x"]
    assert row["tokens/s per device (median)"] == ["100", "150", "1.500x"]


def _curve(runs, title, axis="step"):
    title, ylabel, value, *band = next(c for c in report_page.CURVES if c[0] == title)
    return report_page._curve(plots.pyplot(), title, ylabel, value, runs,
                              report_page.x_axis(axis, runs), *band)


def test_grad_norm_and_gns_with_its_interval_are_drawn(tmp_path):
    gns = {"gns": 3000.0, "gns_low": 2000.0, "gns_high": 5000.0}
    runs = {"g": read_jsonl(_run(tmp_path / "g", **gns))}
    norm = _curve(runs, "Gradient norm").axes[0]
    assert list(norm.get_lines()[0].get_ydata()) == [0.5, 0.25, 1 / 6]
    ax = _curve(runs, "Gradient noise scale").axes[0]
    assert list(ax.get_lines()[0].get_ydata()) == [3000.0] * 3
    (band,) = ax.collections  # the 90% interval, shaded
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.min() == 2000.0 and ys.max() == 5000.0
    # A run that does not measure the GNS draws no GNS figure.
    bare = {"bare": read_jsonl(_run(tmp_path / "bare", gns=None, gns_low=None, gns_high=None))}
    assert _curve(bare, "Gradient noise scale") is None
    html = report_page.page(runs, ["g"], ["run"], [], None, None)
    assert "<figcaption>Gradient norm" in html and "<figcaption>Gradient noise scale" in html


def test_the_x_axis_by_tokens_sums_the_tokens_trained(tmp_path):
    runs = {"t": read_jsonl(_run(tmp_path / "t", checkpoint_saved=True))}
    ax = _curve(runs, "Loss", "tokens").axes[0]
    assert list(ax.get_lines()[0].get_xdata()) == [2048, 4096, 6144]  # step x 1024 tokens
    assert ax.get_xlabel().startswith("tokens trained")
    marks = sorted(ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_linestyle() == ":")
    assert marks == [2048, 4096, 6144]  # the checkpoint marks move with the axis
    out = tmp_path / "r"
    assert main(["report", str(tmp_path / "t"), "--out", str(out), "--x", "tokens"]) == 0
    assert (out / "index.html").is_file()


def test_an_axis_that_is_not_one_is_one_line(tmp_path, capsys):
    bare = _run(tmp_path / "bare")
    out = tmp_path / "r"
    assert main(["report", str(bare), "--out", str(out), "--x", "wall"]) == 2
    err = capsys.readouterr().err
    assert err == "trainspec: error: --x wall: not an axis; one of step, tokens\n"
    assert not out.exists()
