"""Batch-size advice and scaling fits (docs/advice.md): formulas, recovery, bad input."""
import json

import numpy as np
import pytest

import hand_records
from trainspec.cli.main import main
from trainspec.core.advice import TradeOff, recommend_layout, trend
from trainspec.core.scaling import fit


def test_trade_off_passes_through_the_run_and_satisfies_the_hyperbola():
    t = TradeOff.from_run(b_noise=4000.0, batch=1000.0, steps=500.0)
    assert t.steps(1000.0) == pytest.approx(500.0)
    assert t.steps(4000.0) == pytest.approx(2 * t.s_min)  # at B_crit: twice the minimum steps
    assert t.tokens(4000.0) == pytest.approx(2 * t.e_min)  # ... and twice the minimum tokens
    for b in (10.0, 4000.0, 1e6):
        assert t.check(b) == pytest.approx(1.0)


def test_recommended_layout_splits_evenly_and_respects_memory():
    layout = recommend_layout(b_crit_tokens=100 * 128, seq_len=128, replicas=8,
                              max_rows_per_replica=4)
    assert layout.global_batch == 96 and layout.replicas == 8  # 100 rows -> 12 per replica
    assert layout.micro_batch == 32 and layout.accumulation_steps == 3  # 4 rows a replica
    assert recommend_layout(10.0, 128, 8, 4).global_batch == 8  # at least one row each


def test_trend_reads_growth():
    steps = list(range(10, 110, 10))
    assert trend(steps, [50 * 1.02**s for s in steps]) == pytest.approx(1.02**90, rel=1e-6)
    assert trend([1, 2], [1.0, 2.0]) is None


def test_chinchilla_fit_recovers_known_exponents():
    """L = E + A/N^α + B/D^β on a 5 x 5 grid with 1% log-normal noise: the bootstrap 95%
    intervals hold the true exponents and E, and the point estimates are within 0.03."""
    rng = np.random.default_rng(0)
    n = np.repeat(np.geomspace(1e5, 1e8, 5), 5)
    d = np.tile(np.geomspace(1e7, 1e10, 5), 5)
    truth = {"irreducible": 1.7, "exp_params": 0.34, "exp_tokens": 0.28}
    loss = (1.7 + 400 / n**0.34 + 410 / d**0.28) * np.exp(0.01 * rng.standard_normal(n.size))
    f = fit(("params", "tokens"), np.stack([n, d], axis=1), loss, n_boot=40)
    coef, ci = f.coefficients(), f.intervals()
    for key, value in truth.items():
        assert ci[key][0] <= value <= ci[key][1], (key, ci[key])
    assert abs(coef["exp_params"] - 0.34) < 0.03 and abs(coef["exp_tokens"] - 0.28) < 0.03


def test_compute_fit_recovers_exponent_and_predicts_extrapolation():
    rng = np.random.default_rng(1)
    c = np.geomspace(1e12, 1e17, 8)
    law = lambda c: 2.0 + 50 * c**-0.1  # noqa: E731
    loss = law(c) * np.exp(0.005 * rng.standard_normal(c.size))
    f = fit(("compute",), c[:, None], loss, n_boot=40)
    lo, hi = f.intervals()["exp_compute"]
    assert lo <= 0.1 <= hi and hi - lo < 0.05
    _, low, high = f.predict_interval(1e18)
    assert low <= law(1e18) <= high



def _sweep(root, widths, budgets):
    """scaling.json files as `trainspec sweep` writes them, on a Chinchilla-shaped law."""
    for n in widths:
        for d in budgets:
            run = root / f"n{n:g}_d{d:g}"
            run.mkdir(parents=True)
            loss = 1.7 + 400 / n**0.34 + 410 / d**0.28
            (run / "scaling.json").write_text(json.dumps(
                {"params": n, "tokens": d, "compute": 6 * n * d, "loss": loss}))
    return root


def test_scaling_warns_when_the_fit_is_under_determined(tmp_path, capsys):
    """The README's sweep (2 widths x 3 budgets): 5 parameters of L(N, D) from 6 points, N at
    2 values. Each law that the points do not pin down gets one warning line; a 4 x 3 grid
    (every variable at >= 3 values, >= 10 points) gets none."""
    small = _sweep(tmp_path / "small", [1e5, 4e5], [8e3, 16e3, 32e3])
    assert main(["scaling", str(small), "--bootstrap", "10", "--json", str(tmp_path / "s.json")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("trainspec: warning: ") for line in err), err
    assert "L(C) is under-determined: 6 points for 3 parameters" in err[0] and "≥ 7 points" in err[0]
    assert "L(N, D) is under-determined: params takes 2 distinct values" in err[1]
    assert "6 points for 5 parameters" in err[1] and "≥ 10 points" in err[1]
    assert json.loads((tmp_path / "s.json").read_text())["warnings"] == [e[20:] for e in err]

    grid = _sweep(tmp_path / "grid", [1e5, 4e5, 1.6e6, 6.4e6], [8e3, 16e3, 32e3])
    assert main(["scaling", str(grid), "--bootstrap", "10"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "params_tokens: " in out


def _records(path, gns_values, steps=(5, 10, 15, 20), spread=1.2, trend_limited=False,
             source="replicas"):
    """Records whose gns interval is gns / spread to gns * spread, over the last 5 steps."""
    base = {"loss": 3.0, "step_time_s": 0.1, "n_devices": 8,
            "batch_tokens": 32 * 128, "gns_source": source, "gns_window_steps": 5,
            "gns_trend_limited": trend_limited}
    path.write_text("".join(json.dumps(hand_records.record(
        s, **base, gns=g, gns_low=g and g / spread, gns_high=g and g * spread))
        + "\n" for s, g in zip(steps, gns_values)))
    return path


def test_advise_prints_plots_and_writes_json(tmp_path, capsys):
    run = _records(tmp_path / "m.jsonl", [2000.0, 4000.0, 6000.0, 8000.0])
    assert main(["advise", str(run), "--json", str(tmp_path / "a.json"),
                 "--plot", str(tmp_path / "a.png")]) == 0
    out = capsys.readouterr().out
    advice = json.loads((tmp_path / "a.json").read_text())
    assert advice["critical_batch_tokens"] == 8000.0 and "grew" in advice["trend"]["note"]
    rec = advice["recommended"]
    assert rec["global_batch"] == 64 and rec["data_parallel"] == 8  # 8000 / 128 = 62.5 rows
    assert rec["steps"] == pytest.approx(2 * advice["s_min"], rel=0.05)  # near B_crit
    assert advice["current"]["steps"] == pytest.approx(20.0)  # the curve goes through the run
    assert "critical batch B_crit = 8000 tokens" in out and (tmp_path / "a.png").stat().st_size
    assert "90% interval 6667-9600, from the last 5 steps" in out
    assert advice["reliable"] and "reliability: steady over the 5 steps measured" in out
    assert advice["recommended_range"] == [56, 72]  # 52 and 75 rows: 7 and 9 per replica
    assert advice["note"] is None
    small = _records(tmp_path / "small.jsonl", [500.0] * 4)  # under 8 replicas x 128 tokens
    assert main(["advise", str(small)]) == 0
    assert "note: B_crit is below one sequence per replica" in capsys.readouterr().out


def test_advise_says_when_the_trend_makes_any_single_number_unreliable(tmp_path, capsys):
    """An interval wider than x2 over a window that older steps disagree with: the trend, not
    the noise, keeps B_crit from being pinned, and advise says so instead of one batch size."""
    moving = _records(tmp_path / "moving.jsonl", [2000.0, 4000.0, 6000.0, 8000.0], spread=2.0,
                      trend_limited=True)
    assert main(["advise", str(moving), "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    advice = json.loads((tmp_path / "a.json").read_text())
    assert not advice["reliable"] and advice["critical_batch_interval"] == [4000.0, 16000.0]
    assert "reliability: unreliable: B_crit moves faster than it can be measured" in out
    assert "No single batch size fits this run" in out
    assert "a global batch of 32 to 128" in out
    steady = _records(tmp_path / "steady.jsonl", [8000.0] * 4, spread=2.0)
    assert main(["advise", str(steady)]) == 0
    assert "reliability: uncertain: the 5 steps measured pin B_crit only within 4000-16000" in (
        capsys.readouterr().out)
    narrow = _records(tmp_path / "narrow.jsonl", [8000.0] * 4, trend_limited=True)
    assert main(["advise", str(narrow)]) == 0
    assert "reliability: B_crit is moving" in capsys.readouterr().out


def test_advise_reads_the_spec_its_run_dir_was_trained_under(tmp_path, capsys):
    """A run of 16 x 32 tokens per step: the default spec (32 x 128) does not describe it, the
    spec.toml that `trainspec train` saves beside its metrics does."""
    from trainspec.core.spec import load_spec
    from trainspec.core.run_files import save_spec

    records = tmp_path / "metrics.jsonl"
    _records(records, [2000.0] * 4)
    records.write_text(records.read_text().replace('"batch_tokens": 4096', '"batch_tokens": 512'))
    assert "pass the run's spec" in _one_line_exit_2(capsys, ["advise", str(tmp_path)])
    save_spec(load_spec(None, ["batch.global_batch=16", "batch.seq_len=32"]), tmp_path)
    for run in (tmp_path, records):  # the run dir, or its metrics file
        assert main(["advise", str(run)]) == 0
        assert "B_crit = 2000 tokens" in capsys.readouterr().out


def _one_line_exit_2(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainspec: error: "), err
    return err


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    no_gns = tmp_path / "no_gns.jsonl"
    _records(no_gns, [None] * 4, source=None)
    assert "no gns records" in _one_line_exit_2(capsys, ["advise", str(no_gns)])
    _records(no_gns, [4000.0, None])  # the last record: |G|^2 not above 0 over its window
    assert "no B_crit at step 10: over the last 5 steps |G|^2 is not above 0" in (
        _one_line_exit_2(capsys, ["advise", str(no_gns)]))
    assert "no metrics file" in _one_line_exit_2(capsys, ["advise", str(tmp_path / "missing")])
    assert "not a directory" in _one_line_exit_2(capsys, ["scaling", str(tmp_path / "missing")])
    assert "no scaling.json" in _one_line_exit_2(capsys, ["scaling", str(tmp_path)])
    for i in range(3):
        (tmp_path / f"r{i}").mkdir()
        (tmp_path / f"r{i}" / "scaling.json").write_text(json.dumps(
            {"params": 1e4, "tokens": 1e5 * (i + 1), "compute": 6e9 * (i + 1), "loss": 3.0 - i / 10}))
    assert "too few to fit" in _one_line_exit_2(capsys, ["scaling", str(tmp_path)])
    (tmp_path / "r0" / "scaling.json").write_text("{}")
    assert "not a scaling result" in _one_line_exit_2(capsys, ["scaling", str(tmp_path)])
    assert "--widths" in _one_line_exit_2(
        capsys, ["sweep", "--out", str(tmp_path / "s"), "--widths", "0", "--tokens", "1e4"])
    assert "--tokens" in _one_line_exit_2(
        capsys, ["sweep", "--out", str(tmp_path / "s"), "--widths", "16", "--tokens", "many"])


def test_run_summary_gives_the_noise_scale_with_its_interval():
    from trainspec.cli.summary import _gns

    assert _gns({"gns": 11727.3, "gns_low": 8038.1, "gns_high": 21429.0,
                 "gns_window_steps": 9}) == (
        "11727 tokens (B_simple over the last 9 steps, 90% interval 8038-21429; "
        "`trainspec advise` reads it)")
    assert "interval >= 8038 (no upper bound)" in _gns(
        {"gns": 11727.3, "gns_low": 8038.1, "gns_high": None, "gns_window_steps": 9})
