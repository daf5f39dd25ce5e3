"""The CPU peak MFU divides by: measured once per machine, cached atomically under the user's
cache directory, keyed by CPU model and cores (not by framework: jax and torch read the same
entry); its provenance is in the record's `peak_flops_source` and the run summary. (conftest sets
TRAINSPEC_CPU_PEAK=table elsewhere.)"""
import json

import jax
import pytest

from trainspec.cli.summary import print_summary
from trainspec.core import cpu_peak as core_cpu_peak
from trainspec.core import flops as core_flops
from trainspec.core.errors import UserInputError
from trainspec.core.spec import default_spec, load_spec
from trainspec.jax.metrics import cpu_peak, flops


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSPEC_CPU_PEAK", "measure")
    monkeypatch.setenv("TRAINSPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "cpu_matmul_peak.json"


def test_measured_once_then_read_from_the_cache(cache, monkeypatch):
    calls = []
    real = cpu_peak.measure
    monkeypatch.setattr(cpu_peak, "measure", lambda: calls.append(1) or real(sizes=(256,), repeats=2))
    first = flops.peak_flops(default_spec())
    assert calls == [1]
    entry = json.loads(cache.read_text())[cpu_peak.machine_key()]
    local = jax.local_device_count()
    # A 256^2 float32 matmul on any CPU of this decade: between 1 GFLOP/s and 10 TFLOP/s.
    assert 1e9 < entry["flops"] < 1e13
    assert first.flops_per_device == pytest.approx(entry["flops"] / local)
    assert "measured on this machine" in first.source and "measured now" in first.source
    assert f"shared by {local} devices" in first.source
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # no temporary left over

    again = flops.peak_flops(default_spec())
    assert calls == [1] and again.flops_per_device == first.flops_per_device
    assert "cached in" in again.source

    assert entry["measured_with"] == f"jax {jax.__version__}"
    # Another machine has its own entry: measured again, the first one kept.
    monkeypatch.setattr(core_cpu_peak, "machine_key", lambda: "Other CPU | 64 cores")
    flops.peak_flops(default_spec())
    assert calls == [1, 1] and len(json.loads(cache.read_text())) == 2


def test_no_measurement_under_an_override_or_the_table_mode(cache, monkeypatch):
    monkeypatch.setattr(cpu_peak, "measure", lambda: pytest.fail("measured"))
    spec = load_spec(None, ["metrics.peak_flops_per_device=1e12"])
    assert flops.peak_flops(spec).source == "spec:metrics.peak_flops_per_device"
    monkeypatch.setenv("TRAINSPEC_CPU_PEAK", "table")
    table = flops.peak_flops(default_spec())
    assert table.flops_per_device == pytest.approx(
        core_flops.CPU_PROCESS_PEAK_FLOPS / jax.local_device_count())
    assert "not this one" in table.source
    assert not cache.exists()
    monkeypatch.setenv("TRAINSPEC_CPU_PEAK", "guess")
    with pytest.raises(UserInputError, match="TRAINSPEC_CPU_PEAK: expected one of measure, table"):
        flops.peak_flops(default_spec())


def test_a_corrupt_or_unwritable_cache_does_not_stop_the_run(cache, monkeypatch):
    monkeypatch.setattr(cpu_peak, "measure", lambda: {"flops": 2e10, "load_1min": 0.5, "cores": 2,
                                                      "measured_at": "now", "by_size": {}})
    cache.parent.mkdir(parents=True)
    cache.write_text("{torn")
    with pytest.warns(UserWarning, match="unreadable CPU peak cache"):
        peak = cpu_peak.process_peak()
    assert peak.flops_per_device == 2e10 and json.loads(cache.read_text())[core_cpu_peak.machine_key()]
    cache.unlink()
    cache.parent.rmdir()
    cache.parent.parent.joinpath("cache").write_text("a file where the directory should be")
    peak = cpu_peak.process_peak()
    assert peak.flops_per_device == 2e10 and "not cached" in peak.source


def test_summary_prints_the_peak_and_its_source(capsys):
    summary = {"mesh": {"data": 8}, "steps": 4, "accumulation_steps": 1, "initial_loss": 5.0,
               "final_loss": 4.0, "tokens_per_s": 100.0, "step_time_s": 0.1, "mfu": 0.01,
               "peak_flops_per_device": 1.8e10, "peak_flops_source": "measured on this machine: x",
               "goodput": 0.5, "compile_time_s": 1.0, "gns": None, "spec": "s.toml",
               "metrics_file": "m.jsonl"}
    print_summary(summary)
    out = capsys.readouterr().out
    assert "peak           1.8e+10 FLOP/s per device (measured on this machine: x)" in out
    assert "1 micro-batch per step" in out and "(mean over the run)" in out


def test_torch_divides_by_the_entry_jax_measured(cache, monkeypatch):
    """One entry per machine, whichever framework measured it: a torch rank's peak is the
    process peak jax cached, shared by the ranks on the host (no measurement of its own)."""
    torch_peak = pytest.importorskip("trainspec.torch.peak")
    monkeypatch.setattr(cpu_peak, "measure", lambda: core_cpu_peak.entry({256: 3e10}, "jax x"))
    jax_peak = flops.peak_flops(default_spec())
    monkeypatch.setattr(torch_peak, "measure", lambda: pytest.fail("measured again"))
    rank_peak = torch_peak.peak_flops(default_spec(), "cpu", 4)
    assert rank_peak.flops_per_device * 4 == jax_peak.flops_per_device * jax.local_device_count()
    assert "jax x" in rank_peak.source and "shared by 4 devices" in rank_peak.source
