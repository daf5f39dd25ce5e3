"""`trainspec bench collectives` under `trainspec launch`: 2 processes x 4 devices."""
import json
import subprocess
import sys


def test_bench_compares_backends_across_two_processes(tmp_path):
    rows_file = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", "2", "--grace", "2",
         "--", sys.executable, "-m", "trainspec.cli.main", "bench", "collectives",
         "--host-devices", "4", "-b", "16K", "-e", "16K", "--ops", "all_reduce,broadcast",
         "--backends", "xla,ext,hierarchical", "-n", "2", "-w", "1", "--json", str(rows_file)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Process 0 alone prints the table.
    assert proc.stdout.count("# Out of bounds values : 0 OK") == 1
    assert "[rank 0] # 2 processes x 4 devices" in proc.stdout
    assert "[rank 1] #" not in proc.stdout
    assert "hier/xla" in proc.stdout
    rows = json.loads(rows_file.read_text())
    assert {(r["op"], r["backend"]) for r in rows} == {
        (op, b) for op in ("all_reduce", "broadcast") for b in ("xla", "ext", "hierarchical")}
    for r in rows:
        assert r["wrong"] == 0
        # ext's rendezvous is in-process: its group is one process's 4 devices
        assert r["group_size"] == (4 if r["backend"] == "ext" else 8)
