"""Hardware profiles: peak FLOP/s, memory and the alpha-beta cost of each link class.

A profile is a TOML data file (profiles/*.toml) that cites its sources. Two link classes:
`ici` (within a host, or within a TPU slice: `ici_domain_devices`) and `dcn` (across them).
A collective operation moving S bytes per device over a group of n costs
    alpha + alpha_per_peer * (n - 1) + S * bus_factor(kind, n) / bandwidth
(nccl-tests' bus bandwidth: the factor turns S into the bytes each link carries). The latency
grows with the group where each device waits on each of its n - 1 peers: on the shipped
accelerator profiles alpha_per_peer is 0; on the CPU profile the simulated devices are threads
sharing two cores, and a collective waits until each peer has been scheduled to arrive.

`calibrate` refits a profile from this machine's measurements: `trainspec bench collectives
--json` rows (a least-squares line of time against bus bytes gives alpha and 1/bandwidth) and
a matmul peak.
"""
from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

from trainspec.core.errors import UserInputError

PROFILE_DIR = Path(__file__).with_name("profiles")


@dataclasses.dataclass(frozen=True)
class Link:
    alpha_s: float         # latency of one collective operation
    bandwidth_Bps: float   # bus bandwidth per device, bytes/s
    alpha_per_peer_s: float = 0.0  # latency each other device of the group adds

    def latency(self, group: int) -> float:
        return self.alpha_s + self.alpha_per_peer_s * (group - 1)

    def time(self, bus_bytes: float, ops: int = 1, group: int = 1) -> float:
        return ops * self.latency(group) + bus_bytes / self.bandwidth_Bps


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    devices_per_host: int
    memory_bytes: float
    peak_flops: Mapping[str, float]
    achievable_fraction: float
    comm_overlap: float
    ici: Link
    dcn: Link
    sources: tuple[str, ...]
    # The compiler whose programs the profile's memory and communication model: what it
    # does with the step decides the buffers and the collectives (docs/plan.md).
    backend: str
    shared_host_compute: bool = False
    host_cores: int = 1  # cores the shared host compute is spread over (CPU profile)
    # Per step: dispatch and per-operation costs that do not grow with the work (significant
    # for small models on XLA:CPU). Latency, not work the devices share: on this machine the
    # data-parallel step at 2-8 devices does not grow with the devices as compute would
    # (docs/plan.md).
    program_overhead_s: float = 0.0
    # Streaming rate of one device's memory (on the CPU profile the host's, which the devices
    # share); 0 leaves the optimizer update's memory traffic out of the step time.
    memory_bandwidth_Bps: float = 0.0
    ici_domain_devices: int | None = None  # devices one ICI domain spans (default: a host)
    # XLA:CPU lowers a reduce-scatter to an all-reduce and a slice (same S, all-reduce cost).
    reduce_scatter_as_all_reduce: bool = False
    # XLA:CPU moves 16-bit data as float32 in the step's collectives: its all-reduce
    # promotion widens the all-reduces, and it converts 16-bit parameters before gathering.
    collectives_16bit_as_float32: bool = False
    # Attention without stored scores (flash attention); XLA:CPU materialises them.
    fused_attention: bool = False

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise UserInputError(f"--hardware {self.name}: no peak FLOP/s for dtype {dtype}")
        return self.peak_flops[dtype]

    def device_flops(self, dtype: str, devices_in_use: int) -> float:
        """Achievable FLOP/s of one device. On a CPU the devices of a host share its cores,
        and one device's program runs on about one core (XLA:CPU parallelises small ops
        little), so each gets peak / max(devices in use, cores)."""
        rate = self.peak(dtype) * self.achievable_fraction
        if self.shared_host_compute:
            rate /= max(min(devices_in_use, self.devices_per_host), self.host_cores)
        return rate

    def memory_time(self, nbytes: float, devices_in_use: int) -> float:
        """Seconds for one device to stream `nbytes` while `devices_in_use` do the same (on a
        CPU they share the host's memory bandwidth: one device alone uses all its cores)."""
        if not self.memory_bandwidth_Bps:
            return 0.0
        share = min(devices_in_use, self.devices_per_host) if self.shared_host_compute else 1
        return nbytes * share / self.memory_bandwidth_Bps

    @property
    def ici_domain(self) -> int:
        return self.ici_domain_devices or self.devices_per_host

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def available() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def _from_dict(data: dict, origin: str) -> Profile:
    try:
        return Profile(
            name=data["name"], description=data.get("description", ""),
            devices_per_host=int(data["devices_per_host"]), memory_bytes=float(data["memory_bytes"]),
            peak_flops={k: float(v) for k, v in data["peak_flops"].items()},
            achievable_fraction=float(data["achievable_fraction"]),
            comm_overlap=float(data.get("comm_overlap", 0.0)),
            ici=_link(data["ici"]), dcn=_link(data["dcn"]),
            sources=tuple(data.get("sources", ())),
            shared_host_compute=bool(data.get("shared_host_compute", False)),
            host_cores=int(data.get("host_cores", 1)),
            program_overhead_s=float(data.get("program_overhead_s", 0.0)),
            memory_bandwidth_Bps=float(data.get("memory_bandwidth_Bps", 0.0)),
            ici_domain_devices=data.get("ici_domain_devices"),
            backend=str(data["backend"]),
            reduce_scatter_as_all_reduce=bool(data.get("reduce_scatter_as_all_reduce", False)),
            collectives_16bit_as_float32=bool(data.get("collectives_16bit_as_float32", False)),
            fused_attention=bool(data.get("fused_attention", False)),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise UserInputError(f"--hardware {origin}: bad profile ({err!r} missing or malformed)") from None


def _link(data: dict) -> Link:
    return Link(float(data["alpha_s"]), float(data["bandwidth_Bps"]),
                float(data.get("alpha_per_peer_s", 0.0)))


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name (`h100_sxm`, `cpu`, ...) or a TOML file path."""
    path = Path(name_or_path)
    if not path.suffix == ".toml":
        path = PROFILE_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise UserInputError(
            f"--hardware: unknown hardware {name_or_path!r}; shipped: {', '.join(available())} "
            "(or a profile .toml file)")
    return _from_dict(tomllib.loads(path.read_text()), str(name_or_path))


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: link bytes per byte of S on a group of n."""
    if n <= 1:
        return 0.0
    if kind in ("all-reduce", "all_reduce"):
        return 2 * (n - 1) / n
    if kind in ("collective-permute", "permute", "broadcast"):
        return 1.0
    return (n - 1) / n


def fit_link(rows: Iterable[Mapping], op: str = "all_reduce", backend: str = "xla") -> Link:
    """Least-squares alpha and bandwidth from bench-collectives JSON rows of one op/backend:
    time = alpha + bus_bytes / bandwidth, bus_bytes = size * bus_factor."""
    pts = []
    for r in rows:
        if r.get("op") != op or r.get("backend") != backend:
            continue
        factor = r["busbw_gbps"] / r["algbw_gbps"]  # the row's own group size is in it
        pts.append((r["size_bytes"] * factor, r["time_us"] * 1e-6))
    if len(pts) < 2:
        raise UserInputError(f"--calibrate: need bench rows of {op} ({backend}) at 2+ sizes")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    if slope <= 0:
        raise UserInputError(f"--calibrate: {op} time does not grow with size; no bandwidth fit")
    alpha = max(my - slope * mx, 0.0)
    return Link(alpha, 1.0 / slope)


def calibrate(profile: Profile, bench_rows: list[Mapping] | None = None,
              matmul_peak_flops: float | None = None, dcn_rows: list[Mapping] | None = None) -> Profile:
    """The profile with measured links and peak: ICI from in-process bench rows, DCN from
    rows measured across processes, the peak for every dtype from a matmul measurement."""
    changes: dict = {}
    if bench_rows:
        # the bench times collectives back to back, which all devices reach together; the
        # per-peer latency (peers descheduled between collectives) is the profile's
        changes["ici"] = dataclasses.replace(fit_link(bench_rows),
                                             alpha_per_peer_s=profile.ici.alpha_per_peer_s)
    if dcn_rows:
        changes["dcn"] = fit_link(dcn_rows)
    if matmul_peak_flops:
        changes["peak_flops"] = {k: matmul_peak_flops for k in profile.peak_flops}
    if not changes:
        return profile
    note = "calibrated on this machine: " + ", ".join(sorted(changes))
    return dataclasses.replace(profile, sources=profile.sources + (note,), **changes)
