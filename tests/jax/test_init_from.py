"""`trainspec train --init-from RUN_OR_FILE` (trainspec/core/params_file.py): the parameter file
reads back what was written, a bad one is refused in one line naming --init-from and what does
not fit (exit 2, before anything compiles or a rank starts), and the JAX step starts from the
file's numbers on a sharded layout. Both frameworks starting from one file, end to end:
tests/torch/test_torch_equality.py."""
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from trainspec.cli.main import main
from trainspec.core import params_file
from trainspec.core.errors import UserInputError
from trainspec.core.reference_train import initial_params, leaves
from trainspec.jax.params_file import host_params
from trainspec.jax.train import build_job
from tiny import TINY, tiny_spec

SPEC = tiny_spec()
SETS = [a for s in TINY for a in ("--set", s)]


@pytest.fixture
def params():
    """The float32 reference draws (not JAX's): numbers no implementation would make itself."""
    return leaves(initial_params(SPEC.model, seed=7))


@pytest.fixture
def written(tmp_path, params):
    path = tmp_path / params_file.FILE_NAME
    params_file.write(path, params, SPEC.model)
    return path


def test_a_file_and_its_run_dir_read_back_what_was_written(written, params):
    for source in (written, written.parent):
        back = params_file.read(source, SPEC.model)
        assert list(back) == list(params)
        for name, value in params.items():
            np.testing.assert_array_equal(back[name], value)
    assert not written.with_name(written.name + ".tmp").exists()  # renamed into place


def _rewrite(path, tensors, metadata=None):
    save_file(tensors, str(path), metadata=metadata)
    return path


def _bad_files(tmp_path, params):
    """(name, the --init-from source, the words its one line must hold)."""
    model = json.dumps(SPEC.model.model_dump())
    meta = {"trainspec.model": model}
    less = {k: v for k, v in params.items() if k != "head/kernel"}
    more = {**params, "block_1/query/kernel": params["block_0/query/kernel"]}
    wide = {**params, "embedding": np.zeros((256, 64), np.float32)}
    ints = {**params, "final_norm/scale": np.ones(32, np.int32)}
    nans = {**params, "final_norm/scale": np.full(32, np.nan, np.float32)}
    other = json.dumps({**SPEC.model.model_dump(), "n_heads": 4})
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    return [
        ("missing", tmp_path / "absent", "no such file or run directory"),
        ("run dir without file", tmp_path / "empty_run", "has no initial_params.safetensors"),
        ("not safetensors", tmp_path / "garbage.safetensors", "not a safetensors parameter file"),
        ("missing name", _rewrite(tmp_path / "less.st", less, meta), "head/kernel is missing"),
        ("extra name", _rewrite(tmp_path / "more.st", more, meta),
         "block_1/query/kernel is not a parameter of the spec's model"),
        ("wrong shape", _rewrite(tmp_path / "wide.st", wide),
         "embedding has shape (256, 64), the spec's model needs (256, 32)"),
        ("not floating", _rewrite(tmp_path / "ints.st", ints, meta), "final_norm/scale is int32"),
        ("non-finite", _rewrite(tmp_path / "nans.st", nans, meta),
         "final_norm/scale holds non-finite values"),
        ("other model", _rewrite(tmp_path / "other.st", params, {"trainspec.model": other}),
         "written for model.n_heads = 4, the spec has model.n_heads = 2"),
    ]


def test_every_bad_file_is_one_line_naming_init_from_and_what_does_not_fit(tmp_path, params):
    for name, source, words in _bad_files(tmp_path, params):
        with pytest.raises(UserInputError) as err:
            params_file.read(source, SPEC.model)
        line = str(err.value)
        assert line.startswith(f"--init-from {source}") and words in line, (name, line)
        assert "\n" not in line, name


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_the_cli_refuses_a_bad_file_before_training(tmp_path, capsys, framework):
    """exit 2, one line, no traceback; torch refuses it before any rank starts."""
    code = main(["train", "--framework", framework, "--run-dir", str(tmp_path / "run"),
                 "--init-from", str(tmp_path / "absent"), *SETS])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err, (out, err)
    assert err.strip().splitlines() == [
        f"trainspec: error: --init-from {tmp_path / 'absent'}: no such file or run directory"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_init_from_with_a_users_model_is_refused_by_name(tmp_path, capsys, written, framework):
    code = main(["train", "--framework", framework, "--run-dir", str(tmp_path / "run"),
                 "--init-from", str(written), "--model", "anything.py:make"])
    _, err = capsys.readouterr()
    assert code == 2, err
    assert err.strip().splitlines() == [
        "trainspec: error: --init-from: holds the reference model's parameters; a --model "
        "initialises its own (drop one of them)"]


def test_the_python_api_refuses_init_from_with_a_users_model_too(tmp_path, params):
    """`run(model=..., init_from=...)` used to train the model and drop the file unsaid."""
    from trainspec.core.user_model import load
    from trainspec.jax import train as jax_train
    from trainspec.torch import train as torch_train

    model = load("examples/own_model.py:make", SPEC)  # refused before it becomes a job
    for entry in (jax_train.run, torch_train.run):
        with pytest.raises(UserInputError, match="^--init-from: holds the reference model's"):
            entry(SPEC, tmp_path / entry.__module__, model=model, init_from=params)
        assert not (tmp_path / entry.__module__).exists()


def test_a_run_dir_with_checkpoints_resumes_and_says_so(tmp_path, written):
    checkpoints = tmp_path / "run" / "checkpoints"
    assert params_file.resume_note(written, checkpoints) is None
    (checkpoints / "4").mkdir(parents=True)
    note = params_file.resume_note(written, checkpoints)
    assert note.startswith(f"--init-from {written} not used: {checkpoints} has checkpoints")


def test_a_resume_wins_and_restart_starts_from_the_file(tmp_path, capsys, written, params):
    """A run dir with a checkpoint resumes, says --init-from is not used and keeps the file of
    its start; --restart sets the checkpoint aside and starts from the file."""
    run_dir = tmp_path / "run"
    train = ["train", "--quiet", "--run-dir", str(run_dir), *SETS,
             "--set", "checkpoint.interval=2"]
    assert main([*train, "--steps", "2"]) == 0
    seeded = load_file(str(run_dir / params_file.FILE_NAME))
    capsys.readouterr()
    assert main([*train, "--steps", "3", "--init-from", str(written)]) == 0
    err = capsys.readouterr().err
    assert f"--init-from {written} not used" in err and "resumed from step 2" in err, err
    kept = load_file(str(run_dir / params_file.FILE_NAME))
    np.testing.assert_array_equal(kept["embedding"], seeded["embedding"])
    assert main([*train, "--steps", "3", "--init-from", str(written), "--restart"]) == 0
    assert "not used" not in capsys.readouterr().err
    started = load_file(str(run_dir / params_file.FILE_NAME))
    for name, value in params.items():
        np.testing.assert_array_equal(started[name], value, err_msg=name)


def _assert_holds(host: dict, params: dict) -> None:
    assert list(host) == list(params)
    for name, value in params.items():
        np.testing.assert_array_equal(host[name], value, err_msg=name)


def test_the_jax_step_starts_from_the_file_on_a_sharded_layout(params):
    """fsdp 4 x tensor 2: every parameter split, placed shard by shard; gathered back, it is
    the file's numbers, and the seeded init is not."""
    spec = tiny_spec("mesh.axes.data.size=1", "mesh.axes.fsdp.size=4", "mesh.axes.tensor.size=2")
    job = build_job(spec, init=False)
    state = job.init_state(params)
    assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
               for x in jax.tree.leaves(state.params))
    _assert_holds(host_params(state.params), params)
    seeded = host_params(job.init_state().params)
    assert not np.array_equal(seeded["embedding"], params["embedding"])


def test_every_semi_sync_group_and_the_anchor_start_from_the_file(params):
    """DiLoCo keeps the parameters twice (the anchor, and each group's inner copy): both."""
    spec = tiny_spec("semi_sync.inner_steps=2", "mesh.axes.data.size=4", "mesh.axes.fsdp.size=2")
    state = build_job(spec, init=False).init_state(params)
    _assert_holds(host_params(state.anchor), params)
    inner = host_params(state.inner.params)  # (groups, *shape)
    for group in range(4):
        _assert_holds({name: value[group] for name, value in inner.items()}, params)
