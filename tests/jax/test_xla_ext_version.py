"""The load-time check that the compiled xla_ext handlers fit the installed jaxlib's XLA FFI API.

Measured with this repository's module: handlers compiled against jaxlib 0.12.0.1 (FFI API 0.5)
are refused by jaxlib 0.10.2 (API 0.3) when the CPU backend starts ("handler's API version (0.5)
is incompatible with the framework's API version (0.3)"), while handlers compiled against 0.10.2
run on 0.12.0.1. The check turns the first case into one line at import, naming both jaxlibs.
"""
import re
import subprocess
import sys
import textwrap

import jax
import jaxlib.version
import pytest

from trainspec.jax import _xla_ext, xla_ext
from trainspec.core.errors import FfiVersionError


@pytest.mark.parametrize("built,running,fits", [
    ((0, 3), (0, 3), True),
    ((0, 3), (0, 5), True),    # an older minor version: the runtime still accepts it
    ((0, 5), (0, 3), False),   # newer than the runtime knows
    ((1, 0), (0, 5), False),   # another major version: another ABI
    ((0, 5), (1, 5), False),
])
def test_mismatch_rule(built, running, fits):
    problem = xla_ext.ffi_api_mismatch(built, "A", running, "B")
    assert (problem is None) == fits
    if not fits:
        assert "\n" not in problem
        assert f"jaxlib A (XLA FFI API {built[0]}.{built[1]})" in problem
        assert f"jaxlib B (XLA FFI API {running[0]}.{running[1]})" in problem
        assert "--no-build-isolation" in problem


def test_module_records_what_it_was_built_against():
    info = _xla_ext.build_info()
    major, minor = info["xla_ffi_api"]
    assert (major, minor) <= xla_ext.running_ffi_api() and major == xla_ext.running_ffi_api()[0]
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.\d+)?", info["jaxlib"])  # e.g. 0.10.2, 0.12.0.1


def _fake_jaxlib_headers(tmp_path, major, minor):
    api_dir = tmp_path / "xla" / "ffi" / "api"
    api_dir.mkdir(parents=True)
    (api_dir / "c_api.h").write_text(
        f"#define XLA_FFI_API_MAJOR {major}\n// comment\n#define XLA_FFI_API_MINOR {minor}\n")
    return str(tmp_path)


def test_registration_refuses_an_older_runtime(tmp_path, monkeypatch):
    major, minor = _xla_ext.build_info()["xla_ffi_api"]
    include = _fake_jaxlib_headers(tmp_path, major, minor - 1)
    monkeypatch.setattr(jax.ffi, "include_dir", lambda: include)
    with pytest.raises(FfiVersionError, match=(
            rf"jaxlib {jaxlib.version.__version__} \(XLA FFI API {major}\.{minor - 1}\) "
            "is installed")):
        xla_ext.register_handlers()


def test_registration_accepts_a_newer_runtime(tmp_path, monkeypatch):
    major, minor = _xla_ext.build_info()["xla_ffi_api"]
    include = _fake_jaxlib_headers(tmp_path, major, minor + 1)
    monkeypatch.setattr(jax.ffi, "include_dir", lambda: include)
    assert xla_ext.register_handlers() == xla_ext.TARGETS


def test_cli_prints_the_mismatch_as_one_line(tmp_path):
    major, minor = _xla_ext.build_info()["xla_ffi_api"]
    include = _fake_jaxlib_headers(tmp_path, major, minor - 1)
    child = textwrap.dedent(f"""
        import sys, jax
        jax.ffi.include_dir = lambda: {include!r}
        from trainspec.cli.main import main
        sys.exit(main(["train", "--steps", "1", "--run-dir", {str(tmp_path / "run")!r}]))
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "trainspec: error: trainspec.jax's xla_ext was compiled against jaxlib")
