"""health.preflight: a device with a planted faulty reduction is excluded and the run trains
on the rest (docs/spec.md, health.preflight)."""
from tiny import tiny_spec

from spec_jax.health.faults import Faults
from spec_jax.train import run


def test_planted_fault_on_one_device_is_excluded_and_training_goes_on(tmp_path, capsys):
    spec = tiny_spec("health.preflight=true", "train.steps=4", "checkpoint.interval=0")
    summary = run(spec, tmp_path, progress=False, faults=Faults(faulty_reduction=(3, 128)))
    assert summary["preflight"]["excluded"] == [3]
    assert summary["excluded_devices"] == [3]
    assert "device 3 failed" in capsys.readouterr().err
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["badput_s"]["initialization"] >= summary["preflight"]["seconds"]
