"""The trunk's checkpoint policy (trainspec.core.store) over a NumPy backend that writes one
.npy file per array: atomic layout, manifest, verification, quarantine, fallback, refusal,
compatibility. Milliseconds each: no framework is loaded."""
import errno
import json
import os

import numpy as np
import pytest

from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec
from trainspec.core.run_files import checkpoint_framework, refuse_foreign_checkpoints
from trainspec.core.store import (
    MANIFEST, BadCheckpoint, CheckpointRefusal, Checkpoints, NoGoodCheckpoint, agreement,
    check_compatible, due, save_failed)


class NpyFiles:
    """The narrow backend part: a state's bytes into a directory, and back. `np.load` with
    allow_pickle=False: nothing it reads is unpickled."""

    @staticmethod
    def write(directory, state: dict) -> None:
        for name, array in state.items():
            np.save(directory / f"{name}.npy", array, allow_pickle=False)

    @staticmethod
    def read(directory, names) -> dict:
        try:
            return {name: np.load(directory / f"{name}.npy", allow_pickle=False)
                    for name in names}
        except (OSError, ValueError) as err:
            raise BadCheckpoint(str(err)) from None


def state_at(step: int) -> dict:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3) * step, "b": np.full(3, step)}


def save(store: Checkpoints, step: int, keep: int = 3) -> None:
    partial = store.partial(step)
    NpyFiles.write(partial, state_at(step))
    store.seal(step, {"data_position": step}, keep)


def restore(store: Checkpoints, step: int):
    meta = store.verify(step)["meta"]
    return NpyFiles.read(store.directory / str(step), ("w", "b")), meta


@pytest.fixture
def store(tmp_path):
    store = Checkpoints(tmp_path / "checkpoints")
    for step in (2, 4, 6):
        save(store, step)
    return store


def _file(store, step, name="w.npy"):
    return store.directory / str(step) / name


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) - 3] ^= 0x04  # inside the array's values: np.load alone would not notice
    path.write_bytes(bytes(data))


DAMAGE = {
    "bit_flip": lambda s: _flip(_file(s, 6)),
    "truncated": lambda s: _file(s, 6).write_bytes(_file(s, 6).read_bytes()[:40]),
    "garbage": lambda s: _file(s, 6).write_bytes(os.urandom(200)),
    "data_file_removed": lambda s: _file(s, 6).unlink(),
    "manifest_removed": lambda s: _file(s, 6, MANIFEST).unlink(),
    "garbage_manifest": lambda s: _file(s, 6, MANIFEST).write_text("{not json"),
    "manifest_of_another_step": lambda s: _file(s, 6, MANIFEST).write_text(
        _file(s, 4, MANIFEST).read_text()),
    "unlisted_file": lambda s: _file(s, 6, ".metadata").write_bytes(b"\x80\x04planted"),
    "empty_dir": lambda s: [p.unlink() for p in (s.directory / "6").iterdir()],
}


@pytest.mark.parametrize("damage", DAMAGE, ids=str)
def test_a_damaged_newest_step_is_quarantined_and_the_previous_restored_bitwise(
        store, damage, caplog):
    DAMAGE[damage](store)
    state, meta = store.restore_newest(lambda step: restore(store, step))
    assert meta == {"data_position": 4}
    assert all(np.array_equal(state[k], v) for k, v in state_at(4).items())
    assert store.steps() == [4, 2]
    assert (store.quarantine_dir / "6").is_dir()  # moved aside, kept
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("checkpoint 6 is bad (") and \
        "resuming from checkpoint 4" in lines[0], lines


def test_all_bad_is_one_refusal_that_keeps_them(store):
    for step in (2, 4, 6):
        _flip(_file(store, step))
    with pytest.raises(NoGoodCheckpoint, match=r"all 3 checkpoints .* \(newest, 6: the SHA-256 "
                       r"of w.npy differs.*--restart") as refusal:
        store.restore_newest(lambda step: restore(store, step))
    assert isinstance(refusal.value, UserInputError) and "\n" not in str(refusal.value)
    assert store.steps() == [6, 4, 2] and not store.quarantine_dir.exists()


def test_no_checkpoint_is_none_and_a_regular_file_is_refused(tmp_path):
    assert Checkpoints(tmp_path / "absent").restore_newest(lambda s: pytest.fail()) is None
    (tmp_path / "checkpoints").write_text("not a directory")
    with pytest.raises(UserInputError, match="checkpoint.dir: .* is not a directory"):
        Checkpoints(tmp_path / "checkpoints").steps()


def test_a_killed_save_leaves_no_step_and_is_replaced(store):
    partial = store.partial(8)
    NpyFiles.write(partial, state_at(8))  # killed before the seal
    assert store.steps() == [6, 4, 2]
    assert store.partial(8) == partial and not any(partial.iterdir())  # the rerun starts clean
    save(store, 8)
    assert store.steps() == [8, 6, 4] and not partial.exists()  # keep = 3: step 2 deleted


def test_the_manifest_lists_every_file_with_size_and_hash(store):
    manifest = json.loads(_file(store, 6, MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["b.npy", "w.npy"]
    assert manifest["files"]["w.npy"]["size"] == _file(store, 6).stat().st_size
    assert len(manifest["files"]["w.npy"]["sha256"]) == 64


def test_processes_agree_on_one_verdict(store):
    """A step one process could not read is bad for all: `agree` hands back that reason."""
    reasons = []
    agreed = Checkpoints(store.directory, agree=lambda why: reasons.append(why) or (
        "rank 1 could not read it" if len(reasons) == 1 else why))
    assert agreed.restore_newest(lambda step: step) == 4
    assert reasons == [None, None] and agreed.steps() == [4, 2]


def test_agreement_is_the_first_reason_any_process_gave():
    """The `agree` a backend builds from its gather of every process's object."""
    assert agreement(lambda why: [why, None, None])(None) is None
    assert agreement(lambda why: [why, "rank 1: short read", "rank 2: gone"])(None) == \
        "rank 1: short read"
    assert agreement(lambda why: [why, "rank 1: short read"])("rank 0: bad hash") == \
        "rank 0: bad hash"


def test_the_run_length_is_the_newest_readable_checkpoints(tmp_path):
    store = Checkpoints(tmp_path / "checkpoints")
    written_under = {**Spec().to_dict(), "seed": 7}
    for step, total in ((2, 10), (4, 20)):
        store.partial(step)
        store.seal(step, {"total_steps": total, "spec": written_under}, keep=3)
    with pytest.raises(CheckpointRefusal, match="^seed: .* written with 7"):
        store.saved_total_steps(Spec())  # refused before the run writes anything
    _file(store, 4, MANIFEST).write_text("{not json")  # its restore will say why
    with pytest.raises(CheckpointRefusal, match="^seed: "):
        store.saved_total_steps(Spec())
    _file(store, 2, MANIFEST).write_text(_file(store, 2, MANIFEST).read_text().replace(
        '"seed": 7', f'"seed": {Spec().seed}'))
    assert store.saved_total_steps(Spec()) == 10  # the newest whose manifest reads
    assert Checkpoints(tmp_path / "absent").saved_total_steps(Spec()) is None


def test_each_steps_writer_is_known_and_orbax_only_steps_are_refused(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    assert checkpoint_framework(checkpoints) is None
    (checkpoints / "2" / "state").mkdir(parents=True)
    (checkpoints / "2" / "state" / "_CHECKPOINT_METADATA").write_text("{}")
    (checkpoints / "4").mkdir()
    (checkpoints / "4" / "rank-00000.safetensors").write_bytes(b"")
    assert checkpoint_framework(checkpoints) == "torch"  # the newest
    refuse_foreign_checkpoints(checkpoints / "absent", "jax")
    with pytest.raises(UserInputError, match=r"/4 is a checkpoint of the torch implementation; "
                       "resume it with --framework torch"):
        refuse_foreign_checkpoints(checkpoints, "jax")
    (checkpoints / "6").mkdir()  # orbax's own layout: its step metadata at the top
    (checkpoints / "6" / "_CHECKPOINT_METADATA").write_text("{}")
    for look in (checkpoint_framework, lambda d: refuse_foreign_checkpoints(d, "jax")):
        with pytest.raises(UserInputError, match=rf"^checkpoint.dir: {checkpoints}/6 is a JAX "
                           "checkpoint in orbax's own layout, without the manifest"):
            look(checkpoints)


def test_only_the_writer_moves_and_says(store, caplog):
    _flip(_file(store, 6))
    reader = Checkpoints(store.directory, writer=False)
    state, meta = reader.restore_newest(lambda step: restore(reader, step))
    assert meta["data_position"] == 4 and reader.steps() == [6, 4, 2] and not caplog.records


def test_set_aside_moves_all_with_numbered_names_on_repeats(store):
    store.set_aside()
    save(store, 6)
    assert [p.name for p in store.set_aside()] == ["6.1"] and store.steps() == []


@pytest.mark.parametrize("field, value", [("seed", 1), ("batch.global_batch", 16),
                                          ("optimizer.lr", 0.5), ("model.d_model", 8)])
def test_a_resume_refuses_a_changed_computation_field(tmp_path, field, value):
    saved = Spec().to_dict()
    section, *key = field.split(".")
    if key:
        saved[section][key[0]] = value
    else:
        saved[section] = value
    with pytest.raises(UserInputError, match=f"^{field}: the checkpoints in .* were written "
                       f"with {value!r}"):
        check_compatible(saved, Spec(), tmp_path)


def test_placement_may_change_but_not_what_the_state_holds(tmp_path):
    saved = Spec().to_dict()
    saved["mesh"] = {"axes": {"data": 2}}
    check_compatible(saved, Spec(), tmp_path)  # another mesh: fine
    saved["collectives"]["compression"] = "int8"
    with pytest.raises(UserInputError, match="^collectives.compression"):
        check_compatible(saved, Spec(), tmp_path)


def test_due_every_interval_and_at_the_end():
    assert [s for s in range(1, 11) if due(s, 10, 4)] == [4, 8, 10]
    assert not any(due(s, 10, 0) for s in range(1, 11))


@pytest.mark.parametrize("err,said", [
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "Disk quota exceeded"),
    (RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                  '"No space left on device" })'),  # safetensors' SafetensorError text
     "No space left on device"),
], ids=["ENOSPC", "EDQUOT", "wrapped"])
def test_a_full_disk_is_said_as_the_os_says_it_on_every_backend(tmp_path, err, said):
    assert save_failed(tmp_path, err, rank=3) == (
        f"checkpoint.dir: saving to {tmp_path} failed on rank 3: {said}; the newest good "
        "checkpoint there is kept")


def test_another_failed_save_is_its_first_line(tmp_path):
    err = PermissionError(13, "Permission denied")
    assert save_failed(tmp_path, err) == (
        f"checkpoint.dir: saving to {tmp_path} failed: PermissionError: [Errno 13] Permission "
        "denied; the newest good checkpoint there is kept")
