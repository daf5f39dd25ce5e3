"""Checkpoints: atomic, kept N, resumed bit for bit on the same mesh and resharded onto another."""
import shutil
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from trainspec.jax.checkpoint import Checkpointer
from trainspec.core.data import ByteBatches
from trainspec.core.errors import UserInputError
from trainspec.core.store import MANIFEST, Checkpoints
from trainspec.jax.health.faults import Faults, InjectedCrash
from trainspec.core.run_files import AlreadyTrained
from trainspec.jax.train import Job, build_job, run

from run_dirs import recorded_losses
from tiny import tiny_spec

# Sync saves here: the test then knows which checkpoints exist when the injected crash hits.
# (Async saves are exercised by the kill -9 test, which runs the CLI with the defaults.)
SPEC8 = ["mesh.axes.fsdp.size=2", "checkpoint.interval=4", "checkpoint.async_save=false"]
STEPS, CRASH = 10, 6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 10 steps on data=4 x fsdp=2, never stopped."""
    run_dir = tmp_path_factory.mktemp("ref")
    summary = run(tiny_spec(*SPEC8, "metrics.interval=1"), run_dir, steps=STEPS, progress=False)
    assert summary["mesh"] == {"data": 4, "fsdp": 2, "tensor": 1}
    return recorded_losses(run_dir)


def _crash_then_resume(tmp_path, monkeypatch, *resume_overrides):
    spec = tiny_spec(*SPEC8, "metrics.interval=1")
    with pytest.raises(InjectedCrash):
        run(spec, tmp_path, steps=STEPS, progress=False, faults=Faults(crash_at=CRASH))
    fed = []
    original = ByteBatches.batch
    monkeypatch.setattr(ByteBatches, "batch", lambda self, i, *a: fed.append(i) or original(self, i, *a))
    summary = run(tiny_spec(*SPEC8, "metrics.interval=1", *resume_overrides), tmp_path,
                  steps=STEPS, progress=False)
    return summary, fed, recorded_losses(tmp_path)


def test_resume_same_mesh_is_bitwise(tmp_path, monkeypatch, uninterrupted):
    summary, fed, losses = _crash_then_resume(tmp_path, monkeypatch)
    assert summary["resumed_from"] == 4  # checkpoint at 4; steps 5-6 were lost with the crash
    assert fed == list(range(4, STEPS))  # data continues at batch 4: none repeated or skipped
    assert losses == uninterrupted  # every step, bit for bit (records past 4 were redone)


def test_resume_on_four_devices_reshards(tmp_path, monkeypatch, uninterrupted):
    """Saved on data=4 x fsdp=2 (8 devices), resumed on data=2 x fsdp=2 (4 devices).

    Same math, other reduction order: the gradient all-reduce sums 2 shards instead of 4, so the
    float32 sums round differently (~1e-7 relative per step); over 6 steps of AdamW on a tiny
    model that stays below 1e-5 relative in the loss (measured ~1e-6). Bitwise is not promised.
    """
    summary, fed, losses = _crash_then_resume(
        tmp_path, monkeypatch, "mesh.exclude_devices=[4, 5, 6, 7]"
    )
    assert summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1}
    assert summary["resumed_from"] == 4 and fed == list(range(4, STEPS))
    assert set(losses) == set(uninterrupted)
    for step in range(1, 5):  # before the resume: the same records
        assert losses[step] == uninterrupted[step]
    after = np.array([losses[s] for s in range(5, STEPS + 1)])
    ref = np.array([uninterrupted[s] for s in range(5, STEPS + 1)])
    np.testing.assert_allclose(after, ref, rtol=1e-5)
    print("max relative loss difference after resharding:", np.max(np.abs(after / ref - 1)))


def test_restore_into_other_layout_is_exact(tmp_path):
    """The restored arrays equal the saved ones bit for bit, whatever the target sharding."""
    spec8 = tiny_spec(*SPEC8)
    job = build_job(spec8)
    ckpt = Checkpointer(spec8, tmp_path)
    ckpt.save(3, job.state, total_steps=10)
    ckpt.wait()
    from trainspec.jax.mesh import build_mesh
    spec_t = tiny_spec(*SPEC8[1:], "mesh.axes.fsdp.size=4")
    target = build_job(spec_t, build_mesh(spec_t, jax.devices()[:4]), init=False)
    state, meta = Checkpointer(spec_t, tmp_path).restore_latest(target.abstract_state)
    assert meta["step"] == 3 and meta["data_position"] == 3 and meta["spec"]["mesh"]["axes"]["fsdp"]["size"] == 2
    for a, b, t in zip(jax.tree.leaves(state), jax.tree.leaves(job.state), jax.tree.leaves(target.abstract_state)):
        assert a.sharding == t.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unfinished_and_unreadable_checkpoints_are_never_taken(tmp_path):
    spec = tiny_spec("checkpoint.interval=1", "checkpoint.keep=2")
    job = build_job(spec)
    ckpt = Checkpointer(spec, tmp_path)
    for step in (1, 2, 3):  # keep=2: step 1 is deleted
        ckpt.save(step, job.state, total_steps=10)
    ckpt.wait()
    root = ckpt.directory
    assert sorted(p.name for p in root.iterdir()) == ["2", "3"]
    # a save killed before its seal: orbax's files complete, no manifest, never renamed
    shutil.copytree(root / "3" / "state", root / "5.partial" / "state")
    # a step directory that lists but does not read back (a truncated copy)
    shutil.copytree(root / "3", root / "4")
    shutil.rmtree(root / "4" / "state")
    state, meta = Checkpointer(spec, tmp_path).restore_latest(job.abstract_state)
    assert meta["step"] == 3


def test_an_async_save_returns_before_it_is_sealed(tmp_path, monkeypatch):
    """The step goes on while orbax finalizes and the writer seals, in the background; until
    the seal the save is a `<step>.partial`, which is no checkpoint."""
    release, seal = threading.Event(), Checkpoints.seal

    def held_seal(store, *args, **kwargs):
        assert release.wait(60), "the test never released the seal"
        return seal(store, *args, **kwargs)

    monkeypatch.setattr(Checkpoints, "seal", held_seal)
    spec = tiny_spec("checkpoint.interval=1", "checkpoint.async_save=true")
    with Checkpointer(spec, tmp_path) as ckpt:
        ckpt.save(1, build_job(spec).state, total_steps=2)
        assert ckpt.steps() == [] and (ckpt.directory / "1.partial").is_dir()
        release.set()
        ckpt.wait()
        assert ckpt.steps() == [1] and (ckpt.directory / "1" / MANIFEST).is_file()


def test_an_orbax_only_checkpoint_is_refused_by_name(tmp_path):
    """The layout of orbax's CheckpointManager, without the trunk's manifest: one line, and
    the directory left as it is (not quarantined as bad)."""
    step_dir = tmp_path / "checkpoints" / "4"
    (step_dir / "state").mkdir(parents=True)
    (step_dir / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(UserInputError, match=f"^checkpoint.dir: {step_dir} is a JAX checkpoint "
                       "in orbax's own layout"):
        Checkpointer(tiny_spec("checkpoint.interval=1"), tmp_path).restore_latest(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_resume_with_other_model_is_one_line_naming_the_field(tmp_path):
    spec = tiny_spec("checkpoint.interval=1")
    ckpt = Checkpointer(spec, tmp_path)
    ckpt.save(1, build_job(spec).state, total_steps=2)
    ckpt.wait()
    other = tiny_spec("checkpoint.interval=1", "model.d_ff=128")
    with pytest.raises(UserInputError, match=r"^model\.d_ff: .* 64, the spec says 128"):
        Checkpointer(other, tmp_path).restore_latest(build_job(other, init=False).abstract_state)


def _count_checkpointer_closes(monkeypatch) -> list:
    """Each orbax checkpointer closed from now on."""
    closed, close = [], ocp.AsyncCheckpointer.close

    def counted(checkpointer):
        closed.append(checkpointer)
        close(checkpointer)

    monkeypatch.setattr(ocp.AsyncCheckpointer, "close", counted)
    return closed


def test_rerun_of_a_finished_run_restores_its_end_and_trains_nothing(tmp_path, monkeypatch):
    spec = tiny_spec("checkpoint.interval=2", "checkpoint.async_save=false")
    closed = _count_checkpointer_closes(monkeypatch)
    run(spec, tmp_path, steps=4, progress=False)
    assert len(closed) == 1  # the run closes the checkpointer it opened (threads, open files)

    def no_fresh_state(job):
        raise AssertionError("a resume restores into the planned state; it initialises none")

    monkeypatch.setattr(Job, "init_state", no_fresh_state)
    with pytest.raises(AlreadyTrained, match="already at step 4 .*asked to train to step 4"):
        run(spec, tmp_path, steps=4, progress=False)
    assert len(closed) == 2  # and so does a run that ends in an error


def test_closing_never_hides_the_error_that_ended_a_run(tmp_path, monkeypatch):
    def failing_close(checkpointer):
        raise OSError("disk gone")

    monkeypatch.setattr(ocp.AsyncCheckpointer, "close", failing_close)
    with pytest.raises(UserInputError, match="^data: the error in flight$"):
        with Checkpointer(tiny_spec(), tmp_path):
            raise UserInputError("data: the error in flight")
    # With no error in flight, a close that fails is the run's one-line error.
    with pytest.raises(UserInputError, match=r"^checkpoint\.dir: .* failed: OSError: disk gone; "
                       "the newest good checkpoint there is kept$"):
        with Checkpointer(tiny_spec(), tmp_path):
            pass


# What orbax 0.11 raised when a real 1 MiB tmpfs filled during a save (tensorstore's text).
ORBAX_FULL_DISK = (
    'RESOURCE_EXHAUSTED: Error writing "a/0" in OCDBT database at local file "/mnt/ck.orbax-'
    'checkpoint-tmp/ocdbt.process_0/": Failed writing: "/mnt/ck.orbax-checkpoint-tmp/ocdbt.'
    'process_0/d/66a470b8fec3a70c41e67b99acbf0133": Failed to write 403770 bytes to file 14: '
    "No space left on device [os_error_code='28']")


def test_a_full_disk_under_orbax_is_the_trunks_line(tmp_path, monkeypatch):
    """Orbax wraps the OS's ENOSPC in a long RESOURCE_EXHAUSTED text; the line says what the
    torch backend's says for the same disk (trainspec.core.store.save_failed)."""
    def full_disk(checkpointer):
        raise ValueError(ORBAX_FULL_DISK)

    monkeypatch.setattr(ocp.AsyncCheckpointer, "close", full_disk)
    with pytest.raises(UserInputError) as refused:
        with Checkpointer(tiny_spec(), tmp_path):
            pass
    assert str(refused.value) == (f"checkpoint.dir: saving to {tmp_path / 'checkpoints'} "
                                  "failed: No space left on device; the newest good checkpoint "
                                  "there is kept")
