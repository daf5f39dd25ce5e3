"""The session check of tests/conftest.py names what a test left in the checkout (runs/,
report/, a stray file, ignored or not) and nothing the install or the tools make."""
import subprocess

from checkout_guard import checkout_entries, left_behind


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_new_files_in_the_checkout_are_named_and_tool_outputs_are_not(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("runs/\nbuild/\n__pycache__/\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    (tmp_path / "runs" / "old").mkdir(parents=True)  # there before the session: not named
    (tmp_path / "runs" / "old" / "spec.toml").write_text("")
    before = checkout_entries(tmp_path)

    (tmp_path / "runs" / "default").mkdir()  # inside a directory that was there before
    (tmp_path / "runs" / "default" / "spec.toml").write_text("")
    (tmp_path / "report").mkdir()  # untracked
    (tmp_path / "report" / "index.html").write_text("")
    (tmp_path / "stray.txt").write_text("")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "ext.so").write_text("")
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "__pycache__" / "m.pyc").write_text("")
    (tmp_path / "bazel-out").symlink_to(tmp_path / "build")  # Bazel's link in the workspace
    assert left_behind(before, checkout_entries(tmp_path)) == [
        "report/", "report/index.html", "runs/default/", "runs/default/spec.toml", "stray.txt"]


def test_a_new_ignored_directory_is_named(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("runs/\n")
    before = checkout_entries(tmp_path)
    (tmp_path / "runs" / "default").mkdir(parents=True)
    (tmp_path / "runs" / "default" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "runs" / "empty" / "checkpoints").mkdir(parents=True)  # no file: git omits it
    assert left_behind(before, checkout_entries(tmp_path)) == [
        "runs/", "runs/default/", "runs/default/metrics.jsonl", "runs/empty/",
        "runs/empty/checkpoints/"]


def test_outside_a_checkout_nothing_is_checked(tmp_path):
    assert checkout_entries(tmp_path / "absent") is None
    assert left_behind(None, {"runs/"}) == []
