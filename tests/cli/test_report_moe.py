"""`trainspec report` shows the expert fields of a run with experts: the expert load
(max/mean), dropped tokens and the auxiliary losses in the table, and load and drops as curves;
a dense run beside it shows "-". The run summary gives the bytes per step by mesh axis."""
from trainspec.cli.main import main
from trainspec.cli.summary import print_summary
from test_report_compare import _run

MOE = {"moe_load_max_over_mean": 1.5, "moe_dropped_tokens": 12.0,
       "moe_load_balance_loss": 1.0625, "moe_z_loss": 4.25}


def test_expert_load_and_dropped_tokens_are_tabulated_and_drawn(tmp_path, capsys):
    sparse, dense = _run(tmp_path / "moe", **MOE), _run(tmp_path / "dense")
    out = tmp_path / "report"
    assert main(["report", str(sparse), str(dense), "--out", str(out)]) == 0
    rows = {line.split("  ")[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["expert load max/mean (median)"][-3:-1] == ["1.50", "-"]
    assert rows["dropped tokens/step (median)"][-3:-1] == ["12", "-"]
    assert rows["load-balance loss (last)"][-3:-1] == ["1.0625", "-"]
    assert rows["router z-loss (last)"][-3:-1] == ["4.2500", "-"]
    html = (out / "index.html").read_text()
    assert "<figcaption>Expert load" in html and "<figcaption>Dropped tokens" in html


def test_the_summary_gives_bytes_per_step_by_axis(capsys):
    print_summary({"mesh": {"data": 2, "expert": 4}, "steps": 2, "resumed_from": 0,
                   "accumulation_steps": 1, "initial_loss": 5.0, "final_loss": 4.0,
                   "tokens_per_s": 1.0, "step_time_s": 0.1, "spec": "s", "metrics_file": "m",
                   "comm_bytes_per_step": 1326656.0, "comm_bus_bytes_per_step": 1655532.0,
                   "comm_bytes_by_axis": {"expert": 262160.0, "data": 524288.0}})
    comm = next(line for line in capsys.readouterr().out.splitlines() if "comm " in line)
    assert "(by axis: expert 262,160, data 524,288) per step and device" in comm
