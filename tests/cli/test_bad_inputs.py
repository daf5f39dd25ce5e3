"""A fuzz corpus of bad inputs: every bad input gets one line naming it, exit 2, no traceback.

Every case runs `trainspec` (or the function that reads the environment) in-process: the input
is refused before any compile, so the corpus takes seconds.
"""
import io
import sys

import pytest

from trainspec.cli.main import main
from trainspec.core.errors import UserInputError

DEFAULT = "trainspec/default.toml"

# (name, spec file bytes or None for the default spec, extra argv, expected message substring)
VALIDATE_CASES = [
    ("binary spec", b"\xff\xfe\x00\x01garbage", [], "is not UTF-8 text"),
    ("utf-16 spec", "seed = 1\n".encode("utf-16"), [], "is not UTF-8 text"),
    ("latin-1 spec", "# caf\xe9\nseed = 1\n".encode("latin-1"), [], "is not UTF-8 text"),
    ("deep toml", ("a = " + "[" * 3000 + "]" * 3000 + "\n").encode(), [], "nested too deeply"),
    ("bad toml", b"[batch\n", [], "is not valid TOML"),
    ("seed 2**70", f"seed = {2**70}\n".encode(), [], "field 'seed'"),
    ("negative seed", b"seed = -1\n", [], "field 'seed'"),
    ("global_batch 2**70", f"[batch]\nglobal_batch = {2**70}\n".encode(), [],
     "field 'batch.global_batch'"),
    ("d_model 2**70", f"[model]\nd_model = {2**70}\n".encode(), [], "field 'model.d_model'"),
    ("global_batch string", b'[batch]\nglobal_batch = "32"\n', [], "field 'batch.global_batch'"),
    ("global_batch bool", b"[batch]\nglobal_batch = true\n", [], "field 'batch.global_batch'"),
    ("unknown section", b"[batchh]\nglobal_batch = 32\n", [], "did you mean 'batch'?"),
    ("unknown field", b"[batch]\nglobal_bach = 32\n", [], "did you mean 'global_batch'?"),
    ("learning rate inf", b"[optimizer]\nlearning_rate = inf\n", [], "optimizer.learning_rate"),
    ("set on a section", None, ["--set", "batch=1"], "field 'batch'"),
    ("set string number", None, ["--set", 'batch.global_batch="8"'], "batch.global_batch"),
    ("set without =", None, ["--set", "batch.global_batch"], "--set expects"),
    ("set a rule to an unknown axis", None, ["--set", 'layout.rules.batch=["nope"]'],
     "field 'layout.rules.batch': names mesh axis 'nope'"),
    ("host devices -1", None, ["--host-devices", "-1"], "--host-devices: expected 1 to 1024"),
    ("host devices 0", None, ["--host-devices", "0"], "--host-devices: expected 1 to 1024"),
    ("missing spec", "absent", [], "spec file not found"),
]


def _one_line_error(capsys, code, expected):
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainspec: error: "), err
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("content,argv,expected", [c[1:] for c in VALIDATE_CASES],
                         ids=[c[0] for c in VALIDATE_CASES])
def test_validate_refuses_in_one_line(tmp_path, capsys, content, argv, expected):
    if content is None:
        spec = DEFAULT
    elif content == "absent":
        spec = str(tmp_path / "absent.toml")
    else:
        spec = tmp_path / "spec.toml"
        spec.write_bytes(content)
    _one_line_error(capsys, main(["validate", str(spec), *argv]), expected)


def test_report_refuses_binary_and_missing_files(tmp_path, capsys):
    binary = tmp_path / "metrics.jsonl"
    binary.write_bytes(b"\x00\xff\xfe binary")
    _one_line_error(capsys, main(["report", str(binary), "--out", str(tmp_path / "r")]),
                    "not UTF-8 text")
    _one_line_error(capsys, main(["report", str(tmp_path / "absent")]), "metrics file not found")


def test_launch_refuses_a_missing_command(capsys):
    code = main(["launch", "--nprocs", "1", "--", "/nonexistent/cmd"])
    _one_line_error(capsys, code, "command not found: /nonexistent/cmd")


@pytest.mark.parametrize("raw", ["nope", "[1, 2]", '{"x": 1}', '{"bitflip": 3}'])
def test_bad_faults_env_is_one_line(monkeypatch, raw):
    from trainspec.jax.health.faults import ENV, Faults

    monkeypatch.setenv(ENV, raw)
    with pytest.raises(UserInputError, match="TRAINSPEC_FAULTS"):
        Faults.from_env()


def test_bad_init_timeout_env_is_one_line(monkeypatch):
    from trainspec.jax import runtime

    monkeypatch.setenv(runtime.INIT_TIMEOUT, "abc")
    with pytest.raises(UserInputError, match="TRAINSPEC_INIT_TIMEOUT_S"):
        runtime.initialize_from_env()


class _ClosedPipe:
    """stdout whose reader has gone (`trainspec validate ... | head -1`)."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass

    def fileno(self):
        raise io.UnsupportedOperation("no file descriptor")


def test_validate_into_a_closed_pipe_is_quiet(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["validate", DEFAULT]) == 0
    assert capsys.readouterr().err == ""


def test_summary_json_naming_a_directory_is_refused_before_training(tmp_path, capsys):
    code = main(["train", "--summary-json", str(tmp_path), "--run-dir", str(tmp_path / "run")])
    _one_line_error(capsys, code, "is a directory")
    assert not (tmp_path / "run").exists()  # nothing trained


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("trainspec ")


def test_one_micro_batch_is_singular():
    from trainspec.cli.summary import plural

    assert plural(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert plural(4, "micro-batch", "micro-batches") == "4 micro-batches"


def test_unwritable_outputs_are_refused_before_training(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    _one_line_error(capsys, main(["train", "--run-dir", str(a_file)]), "is a file")
    _one_line_error(capsys, main(["train", "--run-dir", str(tmp_path / "r"), "--set",
                                  'metrics.path="."']), "metrics.path")
    (tmp_path / "r2" / "metrics.jsonl").mkdir(parents=True)
    _one_line_error(capsys, main(["train", "--run-dir", str(tmp_path / "r2")]), "metrics.path")
    _one_line_error(capsys, main(["train", "--run-dir", "/proc/trainspec-run"]),
                    "cannot create it")



def test_report_reads_a_run_directory(tmp_path):
    from trainspec.core.records import read_jsonl

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(UserInputError, match="metrics.jsonl: line 1"):
        read_jsonl(run)  # the directory's metrics.jsonl is the file read


def test_report_labels_runs_by_run_directory(tmp_path):
    from trainspec.report.metrics_report import run_names

    (tmp_path / "fsdp").mkdir()
    names = run_names([tmp_path / "default" / "metrics.jsonl", tmp_path / "fsdp",
                       tmp_path / "other.jsonl"])
    assert names == ["default", "fsdp", "other"]
