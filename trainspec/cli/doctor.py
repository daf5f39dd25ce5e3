"""One table (check, status, detail) of checks of this machine; exit status 1 when any fails.

Platform and devices, topology (NUMA nodes, this process's binding, GPUs, NICs), the numerics
self-test per device (sums, means and matmuls against float64 within the bound of each
algorithm, docs/plan.md; trainspec.jax.health.doctor), a quick collective conformance pass and the
bandwidth of the collectives against a hardware profile.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

from trainspec.jax.devices import ensure_host_devices
from trainspec.cli.options import add_host_devices, add_outputs
from trainspec.core.errors import UserInputError

STATUSES = ("ok", "info", "warn", "fail")
BANDWIDTH_WARN = 0.25  # below this share of the profile's bus bandwidth: a warning


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="check this machine: platform, topology, numerics, collectives, links",
        description=__doc__)
    p.add_argument("--hardware", default="cpu", help="profile the link bandwidth is held to")
    p.add_argument("--backends", default="xla,ext", help="collectives backends (default xla,ext)")
    p.add_argument("--quick", action="store_true",
                   help="only the per-device checks (what health.preflight runs)")
    add_host_devices(p)
    add_outputs(p, json="also write the rows as JSON")
    p.set_defaults(func=run)


def _row(check, status, detail, device=None) -> dict:
    return {"check": check, "status": status, "detail": detail, "device": device}


def platform_rows() -> list[dict]:
    import jax
    import jaxlib

    from trainspec.core.topology import allocator_settings, transparent_huge_pages

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    return [
        _row("platform", "info", f"python {platform.python_version()}, jax {jax.__version__}, "
             f"jaxlib {jaxlib.__version__}, {platform.machine()}, {os.cpu_count()} CPUs"),
        _row("devices", "ok" if devices else "fail",
             f"{len(devices)} x {devices[0].platform} ({', '.join(kinds)}), "
             f"{jax.process_count()} process(es)"),
        _row("xla flags", "info", os.environ.get("XLA_FLAGS", "(none)")),
        # jax's switch (JAX_DISABLE_MOST_OPTIMIZATIONS; the test suite sets it) compiles steps
        # that run slower: times and MFU measured under it are not the machine's.
        _row("compiler", "info", "most optimisations disabled (jax_disable_most_optimizations)"
             if jax.config.read("jax_disable_most_optimizations") else "XLA's default optimisation"),
        _row("malloc", "info", f"glibc {allocator_settings(os.environ)}; transparent huge pages "
             f"{transparent_huge_pages()}"),
    ]


def topology_rows() -> list[dict]:
    from trainspec.core import topology

    nodes = topology.numa_nodes()
    allowed = sorted(os.sched_getaffinity(0))
    confined = [n for n, cpus in nodes.items() if set(allowed) <= set(cpus)]
    bind = os.environ.get("TRAINSPEC_BIND", "unset")
    rows = [
        _row("numa nodes", "info", "; ".join(f"node {n}: CPUs {_span(c)}" for n, c in nodes.items())),
        _row("binding", "info", f"affinity CPUs {_span(allowed)} "
             f"({'within node ' + str(confined[0]) if confined else 'spans nodes'}); "
             f"launch --bind {bind}"),
        _row("nics", "info", ", ".join(f"{k} (node {v if v is not None else '-'})"
                                        for k, v in topology.nics().items()) or "(none)"),
    ]
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
        rows.append(_row("gpu topology", "ok" if out.returncode == 0 else "fail",
                         out.stdout.strip().replace("\n", " | ") or out.stderr.strip()))
    else:
        rows.append(_row("gpu topology", "info", "nvidia-smi not found: no GPUs to map"))
    return rows


def _span(cpus) -> str:
    cpus = sorted(cpus)
    parts, start = [], None
    for i, c in enumerate(cpus):
        start = c if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(parts)


def numerics_rows(results) -> list[dict]:
    """One row per check name (worst device), failures naming device and check."""
    by_check: dict[str, list] = {}
    for r in results:
        by_check.setdefault(r.check, []).append(r)
    rows = []
    for check, rs in by_check.items():
        bad = [r for r in rs if not r.ok]
        worst = max(rs, key=lambda r: r.error / r.bound if r.bound else float("inf"))
        detail = f"{len(rs)} devices; worst error {worst.error:.3g} vs bound {worst.bound:.3g}"
        if bad:
            detail = f"devices {[r.device for r in bad]} exceed the bound; " + detail
        rows.append(_row(f"numerics {check}", "fail" if bad else "ok", detail,
                         bad[0].device if bad else None))
    return rows


def collectives_rows(backends, profile) -> list[dict]:
    from trainspec.jax.tools import collectives_bench as bench

    rows = []
    measured = bench.sweep(list(bench.OPS), ["float32"], backends, [64 << 10], "sum", 2, 1)
    for r in measured:
        rows.append(_row(f"conformance {r.op}[{r.backend}]", "ok" if r.wrong == 0 else "fail",
                         f"64K float32: {r.wrong} wrong elements"))
    for r in bench.sweep(["all_reduce"], ["float32"], backends, [4 << 20], "sum", 5, 1):
        share = r.busbw_gbps * 1e9 / profile.ici.bandwidth_Bps
        rows.append(_row(f"bandwidth all_reduce[{r.backend}]",
                         "ok" if share >= BANDWIDTH_WARN else "warn",
                         f"4M: busbw {r.busbw_gbps:.3f} GB/s = {share:.0%} of {profile.name}'s "
                         f"ICI {profile.ici.bandwidth_Bps / 1e9:.3g} GB/s (load {os.getloadavg()[0]:.1f})"))
    return rows


def run(args) -> int:
    from trainspec.core.plan.hardware import load_profile

    profile = load_profile(args.hardware)  # bad names fail before any device work
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    from trainspec.jax.backends import BACKENDS
    for b in backends:
        if b not in BACKENDS:
            raise UserInputError(f"--backends: unknown {b!r}; choose from {', '.join(BACKENDS)}")
    on_one_host = [b for b in backends if BACKENDS[b].checked_on_one_host]
    ensure_host_devices(args.host_devices)
    import jax

    from trainspec.jax.health import doctor
    from trainspec.jax.health.faults import Faults, faulty_reduction

    fault = faulty_reduction(Faults.from_env())
    ids = [d.id for d in jax.local_devices()]
    rows = platform_rows() + topology_rows()
    results = doctor.quick_device_checks(ids, fault)
    if not args.quick:
        from trainspec.jax.collectives.selftest import collective_results

        results += collective_results(ids, on_one_host)
    rows += numerics_rows(results)
    if not args.quick:
        rows += collectives_rows(on_one_host, profile)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    failed = [r for r in rows if r["status"] == "fail"]
    if failed:
        print(f"trainspec doctor: {len(failed)} check(s) failed: "
              + "; ".join(r["check"] for r in failed), file=sys.stderr)
    return 1 if failed else 0


def table(rows) -> str:
    width = max(len(r["check"]) for r in rows)
    lines = [f"{'check':<{width}}  status  detail"]
    lines += [f"{r['check']:<{width}}  {r['status']:<6}  {r['detail']}" for r in rows]
    return "\n".join(lines)

