"""`trainspec bench collectives`: the sweep end to end, its JSON and plot, and bad arguments."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from trainspec.cli.main import main
from trainspec.jax.tools import collectives_bench as bench
from xla_env import without_device_count

HAS_EXT = importlib.util.find_spec("trainspec.jax.collectives.ext") is not None
BACKENDS = "xla,ext" if HAS_EXT else "xla"


def _cli(*args):
    # A fresh process without a device count in XLA_FLAGS: the CLI must set up 8 devices itself.
    env = without_device_count() | {"JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "trainspec.cli.main", "bench", "collectives",
                           *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = _cli("-b", "1K", "-e", "4K", "-f", "4", "--ops", "all", "--dtypes", "float32",
                "--backends", BACKENDS, "-n", "2", "-w", "1",
                "--json", str(out / "rows.json"), "--plot", str(out / "busbw.png"))
    return proc, out


def test_sweep_runs_on_8_devices_and_prints_the_table(sweep_run):
    proc, _ = sweep_run
    assert proc.returncode == 0, proc.stderr
    assert "8 cpu devices" in proc.stdout
    for op in bench.OPS:
        assert f"# {op}" in proc.stdout
    if HAS_EXT:
        assert "ext/xla" in proc.stdout
    assert "Out of bounds values : 0 OK" in proc.stdout
    assert "# Avg bus bandwidth    : " in proc.stdout and "# load average " in proc.stdout


def test_json_rows_have_the_documented_keys_and_definitions(sweep_run):
    proc, out = sweep_run
    rows = json.loads((out / "rows.json").read_text())
    backends = BACKENDS.split(",")
    assert len(rows) == len(bench.OPS) * 2 * len(backends)  # 2 sizes: 1K, 4K
    for row in rows:
        assert list(row) == ["op", "dtype", "redop", "size_bytes", "count", "backend", "time_us",
                             "algbw_gbps", "busbw_gbps", "wrong"]
        assert row["wrong"] == 0
        assert row["size_bytes"] == row["count"] * 4 and row["size_bytes"] in (1024, 4096)
        assert row["algbw_gbps"] == pytest.approx(row["size_bytes"] / row["time_us"] / 1e3)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bench.bus_factor(row["op"], 8))
    assert (out / "busbw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bus_factors_follow_nccl_tests():
    assert bench.bus_factor("all_reduce", 8) == 2 * 7 / 8
    for op in ("reduce_scatter", "all_gather", "all_to_all"):
        assert bench.bus_factor(op, 8) == 7 / 8
    assert bench.bus_factor("broadcast", 8) == bench.bus_factor("permute", 8) == 1


def test_sizes_parse_and_sweep_like_nccl_tests():
    assert [bench.parse_size(t, "x") for t in ("512", "4K", "64M", "1G", "2kb")] == \
        [512, 4096, 64 << 20, 1 << 30, 2048]
    assert bench.size_sweep(4 << 10, 64 << 20, 4) == [4 << (10 + 2 * k) for k in range(8)]


@pytest.mark.parametrize("op,wrong_call", [
    # all_reduce answering max where sum is expected; permute shifting by 2 instead of 1.
    ("all_reduce", lambda x: bench.collectives.all_reduce(x, bench.AXIS, "max")),
    ("permute", lambda x: bench.collectives.permute(x, bench.AXIS, [(r, (r + 2) % 8) for r in range(8)])),
])
def test_wrong_results_are_counted(monkeypatch, op, wrong_call):
    monkeypatch.setattr(bench, "_call", lambda *a: wrong_call)
    [row] = bench.measure(op, "float32", "sum", 1024, "xla", iters=1, warmup=0)
    assert row.wrong > 0


@pytest.mark.skipif(not HAS_EXT, reason="the ext backend is not built")
def test_in_place_rows_sit_beside_the_out_of_place_ones_and_are_exact():
    from trainspec.jax.tools.collectives_report import Table, as_dict

    rows = bench.measure("all_reduce", "float32", "sum", 4096, ["xla", "ext"], iters=2,
                         warmup=1, in_place=True)
    assert [r.variant for r in rows] == ["xla", "xla in-place", "ext", "ext in-place"]
    assert [r.wrong for r in rows] == [0, 0, 0, 0]
    assert [as_dict(r).get("in_place") for r in rows] == [None, True, None, True]
    table = Table(["xla", "ext"], in_place=True)
    lines = [line for r in rows for line in table.add(r)]
    header, line = lines[-2:]
    assert header.split("|")[-2:] == ["  ext/xla ", " ext-ip/xla-ip"]
    ratios = [float(v) for v in line.split("|")[-2:]]
    assert ratios == pytest.approx([rows[2].time_us / rows[0].time_us,
                                    rows[3].time_us / rows[1].time_us], abs=0.006)


def _exit_code(argv) -> int:
    """main's return value, or the code argparse exits with (its own errors raise SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize("args,names", [
    (["-b", "4X"], "-b/--min-bytes"),
    (["-e", "lots"], "-e/--max-bytes"),
    (["-b", "64M", "-e", "4K"], "-b/--min-bytes"),
    (["--ops", "all_reduce,allreduce"], "--ops"),
    (["--dtypes", "float8"], "--dtypes"),
    (["--backends", "xla,nccl"], "nccl"),
    (["-o", "prod"], "-o/--redop"),
    (["-n", "0"], "-n/--iters"),
    (["-f", "1"], "-f/--step-factor"),
    (["--in-place", "--ops", "all_reduce,all_gather"], "--in-place"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, args, names):
    assert _exit_code(["bench", "collectives", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainspec: error:") and err.count("\n") == 1 and names in err, err


def test_bad_size_from_the_shell_has_no_traceback():
    proc = _cli("-b", "4X")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "-b/--min-bytes" in proc.stderr


def test_collectives_bench_names_the_load_and_warns_above_the_cores():
    from trainspec.jax.tools.collectives_report import machine_load_line

    assert machine_load_line(1.0, 2) == "# load average 1.00 (1 min) on 2 cores"
    assert "WARNING: load exceeds the core count" in machine_load_line(3.5, 2)


def test_collectives_bench_names_the_allocator_settings_it_ran_under(tmp_path):
    from trainspec.core.topology import transparent_huge_pages
    from trainspec.jax.tools.collectives_report import allocator_line

    assert allocator_line({"PATH": "/bin"}, "madvise") == (
        "# glibc malloc: defaults; transparent huge pages: madvise")
    assert allocator_line({"MALLOC_ARENA_MAX": "1", "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=9",
                           "HOME": "/root"}, "never") == (
        "# glibc malloc: GLIBC_TUNABLES=glibc.malloc.trim_threshold=9 MALLOC_ARENA_MAX=1; "
        "transparent huge pages: never")
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    assert transparent_huge_pages(str(mode)) == "madvise"
    assert transparent_huge_pages(str(tmp_path / "absent")) == "unknown"
