"""trainspec doctor: passes here; a planted faulty reduction is caught and named; bad input."""
import json

import jax
import numpy as np
import pytest

from trainspec.cli.main import main
from trainspec.core import numerics
from trainspec.core.topology import transparent_huge_pages
from trainspec.jax.health import doctor


@pytest.fixture(scope="module")
def healthy():
    return doctor.quick_device_checks()


def test_numerics_self_test_passes_on_this_machine(healthy):
    bad = [r for r in healthy if not r.ok]
    assert not bad, bad[:5]
    assert {r.device for r in healthy} == set(range(8))


def test_planted_dropped_tail_is_caught_on_that_device_only():
    results = doctor.quick_device_checks(fault=doctor.Fault(device=5, block=128))
    failing = doctor.failing_devices(results)
    assert set(failing) == {5}
    # lengths that are not a multiple of the block lose their tail; 127 < 128 and 1 do not
    assert any("float32 shape=(129,)" in c for c in failing[5]), failing[5]
    assert not any("shape=(127,)" in c or "matmul" in c for c in failing[5])


def test_doctor_cli_fails_naming_the_check(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINSPEC_FAULTS", json.dumps({"faulty_reduction": [2, 128]}))
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--quick", "--json", str(out)]) == 1
    rows = json.loads(out.read_text())
    assert {"check": "malloc", "status": "info", "device": None,
            "detail": f"glibc MALLOC_ARENA_MAX=1; transparent huge pages {transparent_huge_pages()}"
            } in rows
    failed = [r for r in rows if r["status"] == "fail"]
    assert failed and all(r["device"] == 2 and r["check"].startswith("numerics ") for r in failed)
    assert "jnp.sum float32 shape=(129,)" in capsys.readouterr().err


@pytest.mark.parametrize("disabled, says", [(True, "most optimisations disabled"),
                                             (False, "XLA's default optimisation")])
def test_compiler_row_says_whether_most_optimisations_are_disabled(disabled, says):
    from trainspec.cli.doctor import platform_rows

    was = jax.config.read("jax_disable_most_optimizations")  # tests/conftest.py sets it
    jax.config.update("jax_disable_most_optimizations", disabled)
    try:
        row = next(r for r in platform_rows() if r["check"] == "compiler")
    finally:
        jax.config.update("jax_disable_most_optimizations", was)
    assert row["status"] == "info" and row["detail"].startswith(says), row


@pytest.mark.parametrize("argv, says", [(["--hardware", "nope"], "unknown hardware"),
                                         (["--backends", "mpi"], "--backends: unknown")])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    assert main(["doctor", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_the_matmul_bound_admits_any_summation_order_and_not_a_dropped_term():
    """A kernel may sum a dot product's terms in any order (torch's float32 CPU kernel on an
    AVX-512 Xeon went past the pairwise bound): a float32 sum in sequence stays within the
    bound, the same sum with one term left out does not."""
    a = numerics.selftest_inputs(doctor.MATMUL[0], "float32", 11)
    b = numerics.selftest_inputs(doctor.MATMUL[1], "float32", 12)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    in_sequence = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for t in range(a.shape[1]):
        in_sequence += np.outer(a32[:, t], b32[t])  # float32 += float32: rounded each time
    bound = numerics.matmul_error_bound(a, b, "float32", "float32")
    assert np.all(np.abs(in_sequence - a @ b) <= bound)
    dropped = in_sequence - np.outer(a32[:, 100], b32[100])
    assert np.all(np.abs(dropped - a @ b) > bound)
