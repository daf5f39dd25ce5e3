"""Communication volume of one step, read from the compiled (SPMD-partitioned) HLO text.

Each collective instruction contributes its payload S (bytes on one device, nccl-tests'
convention, docs/metrics.md): all-reduce, all-to-all and collective-permute their buffer,
all-gather its gathered output, reduce-scatter its unscattered input. Instructions inside a
while loop count once per iteration (XLA's `known_trip_count`), which matters because the
micro-batch accumulation is a loop. Replica groups are mapped back to the jax mesh axes they
span, so volume is reported per collective kind and per mesh axis.

The `ext` backend's collectives are xla_ext FFI custom calls (`custom_call_target=
"trainspec_<op>"`), invisible to XLA as collectives; they are counted by the same conventions.
Their group size is a static attribute of the call (`group_size` in its backend_config), their
payload is read from the result shape as for XLA's own, and the mesh axes they span from the
`trainspec_axes=...` name scope trainspec.jax.collectives.ext puts on every call (failing that, from
the one set of mesh axes whose sizes multiply to the group size, else "?").
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# xla_ext's custom-call targets (trainspec.jax.collectives.ext) and the kind each one counts as.
# A broadcast has no HLO kind: it keeps its own (bus factor 1, like nccl-tests).
EXT_TARGETS = {
    "trainspec_all_reduce": "all-reduce", "trainspec_all_gather": "all-gather",
    "trainspec_reduce_scatter": "reduce-scatter", "trainspec_all_to_all": "all-to-all",
    "trainspec_permute": "collective-permute", "trainspec_broadcast": "broadcast",
}
EXT_AXES_SCOPE = "trainspec_axes="


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of a collective (`trainspec.jax.collectives` op name, or
    the HLO kind) over `n` members: bytes each member moves per byte of the full size S.
    all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all (n-1)/n; broadcast and
    permute 1 (nccl-tests, doc/PERFORMANCE.md)."""
    if n <= 1:
        return 0.0
    op = op.replace("-", "_")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast, permute (HLO: collective-permute)


DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "s4": 0.5, "u4": 0.5,
}

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s+(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: float          # S on one device, per execution
    group_size: int
    axes: tuple[str, ...]  # mesh axes the groups span; ("?",) when no axis set matches
    count: float           # executions per step (loop trip counts multiplied in; 1/H: every H steps)

    @property
    def bytes_per_step(self) -> float:
        return self.bytes * self.count

    def repeated(self, times: float) -> Collective:
        """This collective run `times` as often (1/H: once every H steps, per step)."""
        return dataclasses.replace(self, count=self.count * times)

    @property
    def bus_bytes_per_step(self) -> float:
        return self.bytes_per_step * bus_factor(self.kind, self.group_size)


@dataclasses.dataclass
class CommVolume:
    """Per-device communication of one step. Byte counts are per step (loops multiplied)."""

    collectives: list[Collective]
    unknown_trip_counts: int = 0  # loops without a known trip count: counted once

    @property
    def total_bytes(self) -> float:
        return sum(c.bytes_per_step for c in self.collectives)

    @property
    def bus_bytes(self) -> float:
        return sum(c.bus_bytes_per_step for c in self.collectives)

    def by_kind(self) -> dict[str, float]:
        return self._sum_by_kind(lambda c: c.bytes_per_step)

    def ops_by_kind(self) -> dict[str, float]:
        """Collective operations executed per step, by kind (loops multiplied)."""
        return self._sum_by_kind(lambda c: c.count)

    def _sum_by_kind(self, value) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for c in self.collectives:
            out[c.kind] += value(c)
        return dict(out)

    def by_axis(self) -> dict[str, float]:
        """Keyed by the mesh axes a collective spans, joined with '+' ("data", "data+fsdp")."""
        out: dict[str, float] = defaultdict(float)
        for c in self.collectives:
            out["+".join(c.axes) or "none"] += c.bytes_per_step
        return dict(out)

    def by_kind_and_axis(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for c in self.collectives:
            out[c.kind]["+".join(c.axes) or "none"] += c.bytes_per_step
        return {k: dict(v) for k, v in out.items()}


def shape_bytes(shape_text: str) -> float:
    """Bytes of an HLO shape (array or tuple), e.g. '(f32[128]{0}, bf16[4,32]{1,0})'."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in DTYPE_BYTES:
            continue  # token[], opaque: no payload
        total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def _top_level_elements(shape_text: str) -> list[str]:
    """'(a, (b, c), d)' -> ['a', '(b, c)', 'd']; an array shape -> [itself]."""
    text = shape_text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 1:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:-1])
    return [p.strip() for p in parts if p.strip()]


def _payload_bytes(kind: str, shape: str, async_start: bool, group_size: int) -> float:
    if async_start:
        # An async start returns (operands, results[, scratch]): the results are the payload.
        elements = _top_level_elements(shape)
        shape = elements[1] if len(elements) >= 2 else elements[0]
    out = shape_bytes(shape)
    if kind == "reduce-scatter":
        return out * group_size  # S is the unscattered input (nccl-tests)
    return out


# -- replica groups -----------------------------------------------------------------------------
def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _parse_int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_replica_groups(line: str, n_devices: int) -> list[list[int]] | None:
    """Groups of partition ids from the three printed forms of XLA's replica groups:
    explicit `{{0,1},{2,3}}`, iota `[2,2]<=[4]` / `[4,2]<=[2,4]T(1,0)`, and mesh axes
    `mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_0'}`. Empty = all devices."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]*)\](?:T\(([0-9,]*)\))?\))?\s*\{([^}]*)\}", line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(s) for _, s in axes]
        names = [a for a, _ in axes]
        if m.group(2):
            ids = _iota(_parse_int_list(m.group(2)), _parse_int_list(m.group(3) or "") or None)
            ids = ids.reshape(sizes)
        else:
            ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        keep = [i for i in range(len(sizes)) if i not in over]
        moved = ids.transpose(keep + over).reshape(-1, int(np.prod([sizes[i] for i in over])))
        return moved.tolist()
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if m:
        shape = _parse_int_list(m.group(1))
        ids = _iota(_parse_int_list(m.group(2)), _parse_int_list(m.group(3) or "") or None)
        return ids.reshape(shape).tolist()
    m = re.search(r"replica_groups=\{(\{[0-9,{}\s]*\})?\}", line)
    if m:
        groups = [_parse_int_list(g) for g in re.findall(r"\{([0-9,\s]*)\}", m.group(1) or "")]
        groups = [g for g in groups if g]
        return groups or [list(range(n_devices))]
    m = re.search(r"source_target_pairs=\{([0-9,{}\s]*)\}", line)
    if m:
        return [_parse_int_list(p) for p in re.findall(r"\{([0-9,\s]*)\}", m.group(1))]
    return None


def axes_of_groups(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes whose variation forms exactly these groups of partition ids.

    Partition p is the device at flat position p of the mesh's device array (the device
    assignment of a jit over that mesh). Size-1 axes are never named; ("?",) if no set fits.
    """
    names = [a for a, s in mesh_shape.items()]
    sizes = [mesh_shape[a] for a in names]
    wanted = {frozenset(g) for g in groups}
    if all(len(g) <= 1 for g in wanted):
        return ()
    ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    real = [i for i, s in enumerate(sizes) if s > 1]
    for r in range(1, len(real) + 1):
        for over in itertools.combinations(real, r):
            keep = [i for i in range(len(sizes)) if i not in over]
            n = int(np.prod([sizes[i] for i in over]))
            candidate = {frozenset(g) for g in ids.transpose(keep + list(over)).reshape(-1, n).tolist()}
            if candidate == wanted:
                return tuple(names[i] for i in over)
    return ("?",)


def _axes_of_size(group_size: int, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The only set of mesh axes (size > 1) whose sizes multiply to `group_size`, else ("?",)."""
    real = [a for a, s in mesh_shape.items() if s > 1]
    fits = [over for r in range(1, len(real) + 1) for over in itertools.combinations(real, r)
            if int(np.prod([mesh_shape[a] for a in over])) == group_size]
    return fits[0] if len(fits) == 1 else ("?",)


def _ext_collective(line: str, target: str, shape: str, mesh_shape: dict[str, int]):
    """(kind, S bytes, group size, axes) of one xla_ext collective custom call."""
    kind = EXT_TARGETS[target]
    m = re.search(r"\bgroup_size\s*=\s*(\d+)", line)
    group_size = int(m.group(1)) if m else 1
    m = re.search(re.escape(EXT_AXES_SCOPE) + r"([^/\"]+)", line)
    if m:
        axes = tuple(a for a in m.group(1).split("+") if mesh_shape.get(a, 1) > 1)
    else:
        axes = _axes_of_size(group_size, mesh_shape) if group_size > 1 else ()
    return kind, _payload_bytes(kind, shape, False, group_size), group_size, axes


def _permute_axes(pairs: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """Axes along which source and target coordinates differ (collective-permute)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    differ: set[int] = set()
    for pair in pairs:
        if len(pair) != 2:
            continue
        a, b = np.unravel_index(pair[0], sizes), np.unravel_index(pair[1], sizes)
        differ.update(i for i in range(len(sizes)) if a[i] != b[i])
    return tuple(names[i] for i in sorted(differ))


# -- module walk --------------------------------------------------------------------------------
def _split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line.strip())
            if m:
                current = m.group(1)
                comps[current] = []
                if line.lstrip().startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        comps[current].append(line)
    return comps, entry


def _trip_count(line: str) -> int | None:
    m = re.search(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)', line)
    return int(m.group(1)) if m else None


def analyze_hlo(hlo_text: str, mesh_shape: dict[str, int]) -> CommVolume:
    """Collectives of the entry computation and everything it calls, loops multiplied out."""
    comps, entry = _split_computations(hlo_text)
    n_devices = int(np.prod(list(mesh_shape.values()))) if mesh_shape else 1
    counts: dict[tuple, int] = defaultdict(int)
    unknown = 0

    def walk(name: str, multiplier: int, depth: int = 0):
        nonlocal unknown
        if depth > 64 or name not in comps:
            return
        for line in comps[name]:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            op = m.group("op")
            base = op.removesuffix("-start")
            if base in KINDS:
                groups = parse_replica_groups(line, n_devices) or [list(range(n_devices))]
                if base == "collective-permute":
                    group_size, axes = 2, _permute_axes(groups, mesh_shape)
                else:
                    group_size = max(len(g) for g in groups)
                    axes = axes_of_groups(groups, mesh_shape)
                size = _payload_bytes(base, m.group("shape"), op.endswith("-start"), group_size)
                counts[(base, size, group_size, axes)] += multiplier
                continue
            target = re.search(r'custom_call_target="(trainspec_\w+)"', line)
            if op == "custom-call" and target and target.group(1) in EXT_TARGETS:
                counts[_ext_collective(line, target.group(1), m.group("shape"), mesh_shape)] += multiplier
                continue
            if op == "while":
                trips = _trip_count(line)
                if trips is None:
                    unknown += 1
                    trips = 1
                body = re.search(r"body=%?([\w.\-]+)", line)
                if body:
                    walk(body.group(1), multiplier * trips, depth + 1)
                continue
            for called in re.findall(r"(?:calls|to_apply|branch_computations)=\{?([^}\s]+)", line):
                for callee in called.split(","):
                    callee = callee.strip().lstrip("%").rstrip(",")
                    if op in ("all-reduce", "reduce", "reduce-window", "scatter", "sort", "map",
                              "select-and-scatter", "reduce-scatter"):
                        continue  # reducers/comparators: scalar code, no collectives
                    walk(callee, multiplier, depth + 1)

    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    walk(entry, 1)
    collectives = [Collective(k, s, g, a, c) for (k, s, g, a), c in counts.items()]
    return CommVolume(collectives, unknown)


def analyze_compiled(compiled, mesh) -> CommVolume:
    """CommVolume of a jax `Compiled` step over `mesh` (a jax.sharding.Mesh)."""
    return analyze_hlo(compiled.as_text(), {a: int(s) for a, s in mesh.shape.items()})
