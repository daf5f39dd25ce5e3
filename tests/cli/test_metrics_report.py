"""`trainspec report` (table, HTML, plots; truncated last line skipped with a warning) and
`trainspec bench step` (interleaved specs side by side with ratios)."""
import base64
import json
import os
import re
from pathlib import Path

import pytest

from metrics_jobs import METRICS_MODEL
from tiny import TINY, tiny_spec
from trainspec.cli.main import main
from trainspec.cli.summary import print_summary
from trainspec.core.transformer_flops import for_spec
from trainspec.jax.metrics.logger import MetricsLogger
from trainspec.core.records import read_jsonl
from trainspec.report import plots
from trainspec.report import page as report_page
from trainspec.report.metrics_report import report
from trainspec.jax.train import build_job

ROOT = Path(__file__).resolve().parents[2]


def _run(layout, run_dir, steps=4, *overrides):
    spec = tiny_spec(*METRICS_MODEL, *overrides, layout=layout)
    job = build_job(spec)
    logger = MetricsLogger.for_run(spec, job.step, job.state, job.data.batch(0), run_dir, steps,
                                   for_spec(spec))
    state = job.state
    logger.start()
    for step in range(1, steps + 1):
        state, metrics = job.step(state, job.data.batch(step - 1))
        logger.after_step(step, metrics)
    logger.close()
    return run_dir / spec.metrics.path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    return [_run("data", base / "data"), _run("fsdp8", base / "fsdp")]


def test_report_compares_runs_with_table_html_and_plots(runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert " data " in text and " fsdp " in text and "/ first" in text  # labelled by run dir
    assert "\nstep ms (median) " in text and "\nloss (last) " in text  # the statistic is named
    # One self-contained file: every plot inline, nothing else written, nothing linked.
    assert [p.name for p in out.iterdir()] == ["index.html"]
    page = (out / "index.html").read_text()
    images = re.findall(r'<img src="([^"]+)"', page)
    assert len(images) >= 6 and all(i.startswith("data:image/png;base64,") for i in images)
    assert all(len(base64.b64decode(i.split(",", 1)[1])) > 1000 for i in images)
    for caption in ("Loss", "Throughput", "Model FLOPs utilisation", "Step time", "Collective"):
        assert f"<figcaption>{caption}" in page
    assert "<style>" in page and "trainspec report: data, fsdp</h1>" in page
    assert "<tr class=ratio><td>fsdp / first</td>" in page  # the ratio row is in the HTML too
    assert f"{os.cpu_count()} cores" in page  # the machine



def test_report_refuses_to_replace_an_earlier_report(runs, tmp_path, capsys):
    """`--out` defaults to `report`, the same directory every time: a second report into it is
    refused in one line naming --out, and the first is left as it was; --force replaces it."""
    out = tmp_path / "report"
    assert main(["report", str(runs[0]), "--out", str(out)]) == 0
    first = (out / "index.html").read_bytes()
    capsys.readouterr()
    assert main(["report", str(runs[1]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainspec: error: --out: ") and "--force" in err
    assert (out / "index.html").read_bytes() == first
    assert main(["report", str(runs[1]), "--out", str(out), "--force"]) == 0
    assert "trainspec report: fsdp</h1>" in (out / "index.html").read_text()
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main(["report", str(runs[0]), "--out", str(a_file)]) == 2
    assert "--out: " in capsys.readouterr().err and a_file.read_text() == ""

def _synthetic_run(path, template, marks):
    """A metrics file of 8 records (steps 1..8) from a real record, with `marks` (step ->
    extra fields) as the trainer writes them on resumes and checkpoints."""
    lines = []
    for step in range(1, 9):
        record = {**template, "step": step, "loss": 5.0 - 0.1 * step, "learning_rate": 1e-3 * step}
        lines.append(json.dumps({**record, **marks.get(step, {})}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_report_marks_resumes_and_checkpoints_on_the_curves(runs, tmp_path):
    template = read_jsonl(runs[0])[-1]
    marked = _synthetic_run(tmp_path / "marked.jsonl", template, {
        3: {"checkpoint_saved": True}, 6: {"checkpoint_saved": True},
        4: {"resumed_from_step": 3, "resumed_from_mesh": "fsdp=8"}})
    plain = _synthetic_run(tmp_path / "plain.jsonl", template, {})
    records = {"marked": read_jsonl(marked), "plain": read_jsonl(plain)}
    assert report_page.checkpoints(records["marked"]) == [3, 6]
    assert report_page.resumes(records["marked"]) == [(4, 3, "fsdp=8")]
    assert report_page.checkpoints(records["plain"]) == report_page.resumes(records["plain"]) == []

    plt = plots.pyplot()
    for title, ylabel, value, *_ in report_page.CURVES:
        if title not in ("Loss", "Throughput", "Model FLOPs utilisation", "Learning rate"):
            continue
        fig = report_page._curve(plt, title, ylabel, value, records)
        ax = fig.axes[0]
        marks = sorted((ln.get_linestyle(), ln.get_xdata()[0]) for ln in ax.get_lines()
                       if ln.get_linestyle() in (":", "--") and len(ln.get_xdata()))
        assert marks == [("--", 3), (":", 3), (":", 6)], (title, marks)  # only the marked run's
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["marked", "plain", "checkpoint saved", "resume"]
        assert any("resumed from 3" in t.get_text() for t in ax.texts)
        plt.close(fig)

    _, page = report([marked, plain], tmp_path / "report")
    html = page.read_text()
    assert "2 checkpoints; resumed at step 4 from step 3 (fsdp=8)" in html
    assert "<figcaption>Learning rate" in html


def test_truncated_last_line_is_skipped_with_a_warning(runs, tmp_path):
    good = runs[0].read_text()
    crashed = tmp_path / "crashed.jsonl"
    crashed.write_text(good + good.splitlines()[-1][:40])  # the writer died mid-line
    with pytest.warns(UserWarning, match="truncated"):
        records = read_jsonl(crashed)
    assert len(records) == len(good.splitlines())
    # A complete last line that is not a record is an error, not something to skip.
    broken = tmp_path / "broken.jsonl"
    broken.write_text(good + "{not json}\n")
    assert main(["report", str(broken), "--out", str(tmp_path / "r")]) == 2


def test_report_bad_input_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "absent.jsonl"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")  # the pre-v1 format
    assert main(["report", str(other), "--out", str(tmp_path)]) == 2
    assert "trainspec.metrics/1" in capsys.readouterr().err


def test_bench_step_runs_specs_side_by_side(tmp_path, capsys):
    out = tmp_path / "bench.json"
    sets = [a for o in (*TINY, *METRICS_MODEL) for a in ("--set", o)]
    argv = ["bench", "step", "--spec", str(ROOT / "examples/data.toml"), "--spec",
            str(ROOT / "examples/fsdp.toml"), "--steps", "2", "--warmup", "1", "--json", str(out), *sets]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fsdp.toml / " in text and "MFU" in text and "comm/step" in text
    results = json.loads(out.read_text())
    data, fsdp = results.values()
    assert data["mesh"] == {"data": 8} and fsdp["mesh"] == {"data": 1, "fsdp": 8}
    assert fsdp["memory_peak_bytes"] < data["memory_peak_bytes"]
    assert len(data["step_times_s"]) == 2 and data["final_loss"] == pytest.approx(fsdp["final_loss"], rel=1e-3)


def test_bench_step_rejects_different_models(tmp_path, capsys):
    other = tmp_path / "wide.toml"
    other.write_text((ROOT / "examples/data.toml").read_text() + "\n[model]\nd_model = 256\n")
    argv = ["bench", "step", "--spec", str(ROOT / "examples/data.toml"), "--spec", str(other)]
    assert main(argv) == 2
    assert "[model] sections" in capsys.readouterr().err


def test_report_and_summary_show_payload_and_bus_bytes(tmp_path, capsys):
    """bf16 compression swaps the gradient all-reduce for an all-to-all and an all-gather of
    half the bytes: the same payload, half the bus bytes (docs/metrics.md, section 5). The
    report's bus row shows the saving the payload row does not."""
    plain = _run("data", tmp_path / "none", 2)
    compressed = _run("data", tmp_path / "bf16", 2, 'collectives.compression="bf16"')
    assert main(["report", str(plain), str(compressed), "--out", str(tmp_path / "r")]) == 0
    table = capsys.readouterr().out
    ratios = {line.split("  ")[0]: float(line.split()[-1].rstrip("x"))
              for line in table.splitlines() if line.startswith("comm MiB/step")}
    assert 0.95 < ratios["comm MiB/step (payload)"] < 1.05, table
    assert 0.45 < ratios["comm MiB/step (bus)"] < 0.55, table

    record = read_jsonl(compressed)[-1]
    print_summary({"mesh": {"data": 8}, "steps": 2, "resumed_from": 0, "accumulation_steps": 2,
                   "initial_loss": 5.0, "final_loss": 4.0, "tokens_per_s": 1.0,
                   "step_time_s": 0.1, "spec": "s", "metrics_file": "m",
                   **{k: record[k] for k in ("comm_bytes_per_step", "comm_bus_bytes_per_step")}})
    comm = next(line for line in capsys.readouterr().out.splitlines() if "comm " in line)
    assert (f"{record['comm_bytes_per_step']:,.0f} B payload, "
            f"{record['comm_bus_bytes_per_step']:,.0f} B bus per step and device") in comm
