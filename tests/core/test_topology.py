"""CPU topology from /sys and `trainspec launch --bind` (trainspec.core.topology)."""
import os
import subprocess
import sys

import pytest

from trainspec.core import topology


def _fake_sys(root, nodes):
    for node, cpus in nodes.items():
        path = root / "devices/system/node" / f"node{node}"
        path.mkdir(parents=True)
        (path / "cpulist").write_text(cpus + "\n")
    net = root / "class/net/eth0/device"
    net.mkdir(parents=True)
    (net / "numa_node").write_text("1\n")
    (root / "class/net/lo").mkdir(parents=True)
    return root


def test_numa_nodes_nics_and_binding_from_a_two_node_sys(tmp_path):
    root = _fake_sys(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"})
    nodes = topology.numa_nodes(root)
    assert nodes == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert topology.nics(root) == {"eth0": 1, "lo": None}
    assert topology.default_policy(nodes) == "numa"
    allowed = set(range(16))
    assert topology.bind_cpus("numa", 1, 4, nodes, allowed) == set(nodes[1])
    assert topology.bind_cpus("numa", 2, 4, nodes, allowed) == set(nodes[0])
    assert topology.bind_cpus("cores", 3, 4, nodes, allowed) == {12, 13, 14, 15}
    assert topology.bind_cpus("none", 0, 4, nodes, allowed) is None
    with pytest.raises(ValueError):
        topology.bind_cpus("sockets", 0, 1, nodes, allowed)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to split")
def test_launch_bind_cores_pins_each_rank():
    show = "import os; print('cpus', sorted(os.sched_getaffinity(0)))"
    out = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "launch", "--nprocs", "2", "--bind", "cores",
         "--", sys.executable, "-c", show], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pinned = sorted(line.split("cpus ")[1] for line in out.stdout.splitlines() if "cpus [" in line)
    allowed = sorted(os.sched_getaffinity(0))
    per = len(allowed) // 2
    assert pinned == sorted(str(allowed[r * per:(r + 1) * per]) for r in range(2))
