"""Both frameworks train in the one run loop of the core, and their numbers
compare: a JAX run and a torch run of the same tiny job go through trainspec.core.run.Run
step by step, and on one machine divide by the same measured CPU peak (the machine's cache
entry, whichever framework measured it), so in `trainspec report` their MFU ratio equals their
tokens/s ratio. The peak planted here (3e10 FLOP/s) is far from the table's 1.46e11, so a
framework that divided by the table instead would be off by 4.9x."""
import collections

import pytest

from tiny import tiny_spec
from trainspec.core import cpu_peak
from trainspec.core.records import read_jsonl
from trainspec.core.run import Run
from trainspec.report.metrics_report import summarize

PLANTED = 3e10


@pytest.fixture
def measured_peak(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_peak.MODE_ENV, "measure")
    monkeypatch.setenv(cpu_peak.CACHE_ENV, str(tmp_path / "cache"))
    assert cpu_peak.store(cpu_peak.entry({1024: PLANTED}, "planted by the test")) is None


def test_one_loop_and_the_mfu_ratio_is_the_tokens_per_s_ratio(measured_peak, tmp_path,
                                                              monkeypatch):
    pytest.importorskip("torch")
    from trainspec.jax.train import run as train_jax
    from trainspec.torch.train import run as train_torch

    steps_seen = collections.Counter()  # framework -> steps that went through the core's Run
    after_step = Run.after_step

    def counted(run, state, metrics):
        steps_seen[run.step.framework] += 1
        return after_step(run, state, metrics)

    monkeypatch.setattr(Run, "after_step", counted)
    spec = tiny_spec("checkpoint.interval=0", "metrics.interval=2")  # data = all devices
    train_jax(spec, tmp_path / "jax", steps=6, progress=False)
    train_torch(spec, tmp_path / "torch", steps=6, progress=False)  # one rank, in process
    assert steps_seen == {"jax": 6, "torch": 6}
    runs = {name: read_jsonl(tmp_path / name) for name in ("jax", "torch")}
    for records in runs.values():
        assert all("planted by the test" in r["peak_flops_source"] for r in records)
    jax_run, torch_run = (summarize(records) for records in runs.values())
    mfu_ratio = torch_run["mfu"] / jax_run["mfu"]
    tokens_ratio = torch_run["tokens_per_s"] / jax_run["tokens_per_s"]
    assert mfu_ratio == pytest.approx(tokens_ratio, rel=0.02)
