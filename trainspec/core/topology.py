"""This host's CPU topology from Linux's /sys and the CPU sets a rank is bound to.

NUMA nodes and their CPUs (/sys/devices/system/node/node*/cpulist), each network interface's
NUMA node (/sys/class/net/*/device/numa_node; -1 or absent = none reported), and the binding
policy of `trainspec launch --bind`: `numa` gives rank r the CPUs of node r mod nodes, `cores`
splits the allowed CPUs into equal contiguous blocks, one per local rank, `none` leaves them.
Also the glibc malloc settings a process runs under, which move the times of collectives with
large outputs (docs/collectives.md).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

SYS = Path("/sys")
BIND_POLICIES = ("numa", "cores", "none")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(sys_root: Path = SYS) -> dict[int, list[int]]:
    """NUMA node -> CPUs; one node holding every online CPU where /sys shows no nodes."""
    nodes = {}
    for path in sorted((sys_root / "devices/system/node").glob("node[0-9]*")):
        cpus = parse_cpulist((path / "cpulist").read_text())
        if cpus:
            nodes[int(path.name[4:])] = cpus
    if not nodes:
        online = sys_root / "devices/system/cpu/online"
        nodes = {0: parse_cpulist(online.read_text()) if online.exists() else [0]}
    return nodes


def nics(sys_root: Path = SYS) -> dict[str, int | None]:
    """Network interface -> NUMA node (None: virtual, or not reported)."""
    out = {}
    for path in sorted((sys_root / "class/net").glob("*")):
        node_file = path / "device" / "numa_node"
        node = int(node_file.read_text()) if node_file.exists() else -1
        out[path.name] = node if node >= 0 else None
    return out


def bind_cpus(policy: str, local_rank: int, local_ranks: int, nodes: dict[int, list[int]],
              allowed: set[int]) -> set[int] | None:
    """The CPUs a rank is pinned to under `policy` (None: leave its affinity alone)."""
    if policy not in BIND_POLICIES:
        raise ValueError(f"unknown bind policy {policy!r}; one of {', '.join(BIND_POLICIES)}")
    if policy == "none":
        return None
    if policy == "numa":
        ids = sorted(nodes)
        cpus = set(nodes[ids[local_rank % len(ids)]]) & allowed
        return cpus or set(allowed)
    ordered = sorted(allowed)
    per = max(1, len(ordered) // max(1, local_ranks))
    start = (local_rank * per) % len(ordered)
    return set(ordered[start:start + per])


def default_policy(nodes: dict[int, list[int]]) -> str:
    return "numa" if len(nodes) > 1 else "none"


def allocator_settings(environ: Mapping[str, str]) -> str:
    """glibc's malloc settings in `environ` (`MALLOC_*`, `GLIBC_TUNABLES`), or "defaults".

    With glibc's per-thread arenas (the default) freed heaps go back to the kernel and large
    outputs land on fresh pages, which the kernel must zero, which moves the all_reduce times
    of both backends by up to 3x (docs/results.md, "Quiet and loaded side by side").
    """
    settings = sorted(f"{k}={v}" for k, v in environ.items()
                      if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
    return " ".join(settings) if settings else "defaults"


THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages(path: str = THP_MODE) -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or "unknown".

    ext's collectives advise huge pages for outputs of 1 MiB and more, which cuts their
    first-touch faults; under "never" that advice does nothing (docs/xla_ext.md)."""
    try:
        with open(path) as f:
            modes = f.read().split()
    except OSError:
        return "unknown"
    chosen = [m[1:-1] for m in modes if m.startswith("[") and m.endswith("]")]
    return chosen[0] if chosen else "unknown"
