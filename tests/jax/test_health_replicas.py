"""Replica fingerprints: one flipped bit in one replica is caught and named; no false alarms."""
import jax
import pytest

from trainspec.core.health import HealthHalt
from trainspec.jax.health.faults import Faults
from trainspec.jax.health.replicas import ReplicaFingerprints, flip_bit
from trainspec.jax.train import build_job, run

from tiny import tiny_spec

pytestmark = pytest.mark.slow

FSDP2 = "mesh.axes.fsdp.size=2"  # data=4 x fsdp=2: 4 copies of each fsdp shard


@pytest.fixture(scope="module")
def job():
    return build_job(tiny_spec(FSDP2))


def _corrupt_one(state, device_id, leaf=-1):
    leaves, treedef = jax.tree.flatten(state.params)
    leaves[leaf] = flip_bit(leaves[leaf], device_id, flat_index=3, bit=7)
    return state.replace(params=jax.tree.unflatten(treedef, leaves))


def test_clean_state_has_no_divergence(job):
    assert ReplicaFingerprints(job.step.mesh, ("data",)).check(job.state) == []


@pytest.mark.parametrize("device_id", [0, 5])
def test_one_flipped_bit_names_replica_and_device(job, device_id):
    checker = ReplicaFingerprints(job.step.mesh, ("data",))
    found = checker.check(_corrupt_one(job.state, device_id))
    assert len(found) == 1
    (div,) = found
    coords = [tuple(c) for c in zip(*(job.step.mesh.devices == jax.devices()[device_id]).nonzero())][0]
    assert div.devices == (device_id,) and div.replicas == (coords[0],)  # data is axis 0
    assert div.copies == 4 and "head" in div.leaf
    assert f"replica {coords[0]} (device {device_id})" in div.describe()


def test_two_copies_have_no_majority_so_both_are_named():
    job = build_job(tiny_spec("mesh.axes.data.size=2", "mesh.axes.fsdp.size=4"))
    found = ReplicaFingerprints(job.step.mesh, ("data",)).check(_corrupt_one(job.state, 1))
    assert len(found) == 1 and 1 in found[0].devices and len(found[0].devices) == 2


def test_no_false_alarm_over_a_long_run(tmp_path):
    """40 steps with a check every step: parameters change every step, replicas never differ."""
    spec = tiny_spec(FSDP2, "health.fingerprints.interval=1", "health.fingerprints.policy='halt'",
                     "checkpoint.interval=0", "metrics.interval=10")
    summary = run(spec, tmp_path, steps=40, progress=False)
    assert summary["rollbacks"] == [] and summary["steps"] == 40


def test_bitflip_in_a_run_halts_under_halt_policy(tmp_path):
    spec = tiny_spec(FSDP2, "health.fingerprints.interval=2", "health.fingerprints.policy='halt'",
                     "checkpoint.interval=0")
    with pytest.raises(HealthHalt, match=r"after step 4: replica \d \(device 5\) diverged"):
        run(spec, tmp_path, steps=8, progress=False, faults=Faults(bitflip=(3, 5)))


def test_bitflip_rolls_back_onto_the_other_devices(tmp_path):
    """Caught at the next check (step 6), device 5 excluded, the run resumes from the checkpoint
    of step 4 on the largest mesh of the 7 others (data=2 x fsdp=2) and finishes."""
    spec = tiny_spec(FSDP2, "health.fingerprints.interval=2", "checkpoint.interval=4",
                     "checkpoint.async_save=false")
    summary = run(spec, tmp_path, steps=10, progress=False, faults=Faults(bitflip=(5, 5)))
    (rollback,) = summary["rollbacks"]
    assert (rollback["step"], rollback["restored_step"], rollback["excluded"]) == (6, 4, [5])
    assert summary["excluded_devices"] == [5]
    assert summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    assert summary["last_checkpoint"] == 10
    assert summary["badput_s"]["lost_progress"] > 0  # steps 5-6, done and thrown away
