"""The spec's conformance suite, run against any implementation of the adapter interface.

Families (each a row of the table `trainspec conformance --impl NAME` prints):
- one per collective: every case of trainspec.core.conformance on every layout and dtype,
  against the float64 reference within its tolerance (exact for data movement, max/min and
  integers);
- `special values`: 16-bit sums a 16-bit accumulator gets wrong; NaN and infinities through
  max/min;
- `illegal calls`: the calls every implementation must refuse, with the same message;
- `guarantee levels`: every op declares one of the spec's levels; a `deterministic` one must
  give bitwise-identical results when the same call runs again;
- `compression bounds`, `error feedback`: for each `collectives.compression` the
  implementation offers, every format and block of trainspec.core.conformance, the round trip
  within its stated bound, and the new residual exactly (x + residual) - dequantized; skipped,
  saying so, where the implementation offers none;
- `capability table`: the implementation declares every field of the schema
  (trainspec/core/capabilities.py): an undeclared field fails, named;
- `reference trajectory`, `accumulation`, `layout invariance`, `metric records`: training
  steps against the references the suite ships (trainspec/core/conformance_steps.py).
Framework-free: it calls only the interface (trainspec/core/adapter.py).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from trainspec.core.adapter import GUARANTEES, Adapter
from trainspec.core import conformance as cases
from trainspec.core.capabilities import schema_fields
from trainspec.core.conformance import Row
from trainspec.core.conformance_experts import experts_row
from trainspec.core.conformance_steps import records_row, step_rows
from trainspec.core.golden import ragged_batch  # noqa: F401  (tests build batches with it)
from trainspec.core.mesh import resolve_mesh
from trainspec.core.records import FIELDS, SCHEMA_ID
from trainspec.core.simulated import SimulatedDevices

# the devices the suite's collective layouts span
SUITE_DEVICES = 8

# `--quick`: a group of all 8 and groups of 3 of 6 devices; a 32-bit float, a 16-bit float
# (accumulated in float32) and an integer.
QUICK_LAYOUTS, QUICK_DTYPES = ("grid", "rows3"), ("float32", "bfloat16", "int32")


# -- collectives ------------------------------------------------------------------------------

def _collective(adapter: Adapter, layout, case, dtype: str, x=None) -> str | None:
    """None if the case passes on this process's members, else what went wrong. `x`: the
    operand over the whole mesh (default: the suite's seeded inputs)."""
    local_shape, kwargs = case.resolve(layout.n)
    if x is None:
        x = cases.inputs(layout, local_shape, dtype, case.id)
    x = adapter.round_trip(x, dtype)
    out = adapter.run_collective(layout.mesh_shape, layout.mesh_axes, case.op, x, dtype,
                                 layout.group, **kwargs)
    want, tol = cases.expected(layout, case, dtype, x)
    for coords, got in out.items():
        got = np.asarray(got)
        if got.shape != want[coords].shape:
            return f"member {coords}: shape {got.shape}, expected {want[coords].shape}"
        got, exact = got.astype(np.float64), want[coords]
        with np.errstate(invalid="ignore"):  # inf - inf: equal infinities are compared by ==
            err = np.abs(got - exact)
            ok = (err <= tol[coords]) | (got == exact) | (np.isnan(got) & np.isnan(exact))
        bad = ~ok
        if bad.any():
            return (f"member {coords}: {int(bad.sum())} of {bad.size} elements out of "
                    f"tolerance (worst error {np.nanmax(err):.3g})")
    return None


def _collective_rows(adapter: Adapter, quick: bool) -> list[Row]:
    rows = {op: Row(op) for op in dict.fromkeys(c.op for c in cases.CASES)}
    layouts = cases.LAYOUTS + [cases.GROUP_ORDER]
    if quick:
        layouts = [lay for lay in layouts if lay.name in QUICK_LAYOUTS]
    for layout in layouts:
        for case in cases.CASES:
            for dtype in QUICK_DTYPES if quick else cases.DTYPES:
                if dtype == "int32" and case.needs_float:
                    continue
                problem = _collective(adapter, layout, case, dtype)
                verdicts = adapter.gather_objects(problem)  # the same table on every process
                bad = next((v for v in verdicts if v), None)
                rows[case.op].add(bad is None, f"{case.id} {dtype} {layout.name}: {bad}")
    return list(rows.values())


def _special_row(adapter: Adapter) -> Row:
    """Inputs that a plain implementation gets wrong: 16-bit sums that a 16-bit accumulator
    rounds away (element j holds a large value on member j, 1 elsewhere, so every order of
    addition occurs), and NaN and infinities through max/min."""
    row, layout = Row("special values"), cases.LAYOUTS[0]
    n, total = layout.n, cases.Case("sum", "all_reduce", lambda n: (n,), lambda n: {"op": "sum"})
    for dtype, big in (("bfloat16", 256.0), ("float16", 2048.0)):
        x = np.ones(layout.mesh_shape + (n,)) + np.eye(n).reshape(layout.mesh_shape + (n,)) * (big - 1)
        problem = _collective(adapter, layout, total, dtype, x)
        row.add(not any(adapter.gather_objects(problem)), f"{dtype} sums: {problem}")
    x = cases.inputs(layout, (3,), "float32", "special")
    x[(1, 0)], x[(2, 1)], x[(3, 2)] = np.nan, np.inf, -np.inf
    for red in ("max", "min"):
        case = cases.Case(red, "all_reduce", lambda n: (3,), lambda n, r=red: {"op": r})
        problem = _collective(adapter, layout, case, "float32", x)
        row.add(not any(adapter.gather_objects(problem)), f"{red} with NaN/inf: {problem}")
    return row


def _illegal_row(adapter: Adapter) -> Row:
    row, layout = Row("illegal calls"), cases.LAYOUTS[0]
    calls = [(op, shape, kw, pattern, "float32") for op, shape, kw, pattern in cases.ILLEGAL]
    calls.append(("all_reduce", lambda n: (2,), lambda n: {"op": "mean"}, cases.ILLEGAL_MEAN,
                  "int32"))
    for op, shape, kwargs, pattern, dtype in calls:
        x = np.zeros(layout.mesh_shape + shape(layout.n))
        try:
            adapter.run_collective(layout.mesh_shape, layout.mesh_axes, op, x, dtype,
                                   layout.group, **kwargs(layout.n))
            row.add(False, f"{op} {kwargs(layout.n)}: accepted")
        except ValueError as err:
            row.add(bool(re.search(pattern, str(err))), f"{op}: message {err}")
    return row


def _guarantee_row(adapter: Adapter) -> Row:
    row, layout = Row("guarantee levels"), cases.LAYOUTS[0]
    for op in dict.fromkeys(c.op for c in cases.CASES):
        level = adapter.guarantee_levels.get(op)
        row.add(level in GUARANTEES, f"{op}: declares {level!r}")
        if level != "deterministic":
            continue
        case = next(c for c in cases.CASES if c.op == op)
        x = cases.inputs(layout, case.resolve(layout.n)[0], "float32", case.id)
        runs = [adapter.run_collective(layout.mesh_shape, layout.mesh_axes, op, x, "float32",
                                       layout.group, **case.resolve(layout.n)[1]) for _ in range(3)]
        same = all(np.array_equal(runs[0][k], r[k], equal_nan=True) for r in runs[1:] for k in runs[0])
        row.add(all(adapter.gather_objects(same)), f"{op}: results differ between runs")
    return row


# -- collectives.compression ------------------------------------------------------------------

def _compression_rows(adapter: Adapter) -> list[Row]:
    """Per format, block and size: the round trip within the stated bound, and the new
    residual exactly (x + residual) - dequantized, in float32."""
    bounds, feedback = Row("compression bounds"), Row("error feedback")
    if not adapter.compressions:
        bounds.skipped = feedback.skipped = (
            f"{adapter.name} reports collectives.compression unsupported")
        return [bounds, feedback]
    for compression, block in cases.COMPRESSION_FORMATS:
        if compression not in adapter.compressions:
            continue
        for size in cases.COMPRESSION_SIZES:
            what = f"{compression} block {block}, {size} elements"
            x, residual = cases.compression_inputs(size, what)
            sent = adapter.error_feedback(x, np.zeros_like(x), compression, block)[0]
            err = np.abs(np.asarray(sent, np.float64) - x)
            bound = cases.compression_bound(x, compression, block)
            bounds.add(bool(np.all(err <= bound)),
                       f"{what}: error {np.max(err - bound):.3g} above the bound")
            sent, new_residual = adapter.error_feedback(x, residual, compression, block)
            want = (x + residual) - np.asarray(sent, np.float32)
            feedback.add(np.array_equal(np.asarray(new_residual, np.float32).view(np.uint32),
                                        want.view(np.uint32)),
                         f"{what}: new residual is not (x + residual) - dequantized")
    return [bounds, feedback]


# -- the capability table ---------------------------------------------------------------------

def _capability_row(adapter: Adapter) -> Row:
    row, table = Row("capability table"), getattr(adapter, "capabilities", None)
    for field in schema_fields():
        row.add(table is not None and table.declares(field),
                f"{field}: not declared by {adapter.name}'s capability table")
    return row


def run(adapter: Adapter, quick: bool = False) -> list[Row]:
    """Every family's row; `quick` runs the collectives on QUICK_LAYOUTS and QUICK_DTYPES only."""
    return [*_collective_rows(adapter, quick), _special_row(adapter), _illegal_row(adapter),
            _guarantee_row(adapter), *_compression_rows(adapter), _capability_row(adapter),
            *step_rows(adapter), experts_row(adapter), records_row(adapter)]


class _Counting(SimulatedDevices):
    """Stands in for an implementation to count the suite's cases: its declarations (guarantee
    levels, compressions, capability table), the core's answers and no training."""

    def __init__(self, target: Adapter):
        self.name, self.capabilities = target.name, target.capabilities
        self.guarantee_levels, self.compressions = target.guarantee_levels, target.compressions

    def build_mesh(self, spec):
        return resolve_mesh(spec, self.devices)

    def error_feedback(self, x, residual, compression, block):
        return x, residual

    def train_steps(self, spec, params, batches):
        return [(0.0, 0.0, params) for _ in batches]

    def train_run(self, spec, run_dir, steps):
        """Records that read back (every required field, of its schema type), numbers none."""
        sink = self.open_metrics(run_dir / spec.metrics.path)
        for step in range(1, steps + 1):
            sink.write({**{name: _PLACEHOLDERS[_first_type(field)]
                           for name, field in FIELDS.items()},
                        "schema": SCHEMA_ID, "step": step})
        sink.close()
        return {}


_PLACEHOLDERS = {"number": 0.0, "integer": 0, "string": "", "object": {}, "array": [],
                 "boolean": False, "null": None}


def _first_type(field: dict) -> str:
    types = field.get("type", "null")
    return types if isinstance(types, str) else types[0]


def count_cases(target: Adapter, quick: bool = False) -> list[Row]:
    """The rows the suite would give `target` on 8 devices, with every case counted as passed:
    how many cases each family has for it (nothing of it runs)."""
    rows = run(_Counting(target), quick)
    return [dataclasses.replace(r, passed=r.passed + r.failed, failed=0, first_failure="")
            for r in rows]


def table(impl: str, rows: list[Row]) -> str:
    """The verdicts, one line per family; a case the implementation's capability table
    refuses is not counted, and its first refusal is named."""
    lines = [f"conformance of {impl}", f"{'family':<20} {'cases':>6} {'passed':>7} {'failed':>7}  verdict"]
    for r in rows:
        if r.skipped:
            lines.append(f"{r.family:<20} {'-':>6} {'-':>7} {'-':>7}  skipped: {r.skipped}")
            continue
        verdict = "pass" if not r.failed else f"FAIL: {r.first_failure}"
        if r.refused:
            verdict += f"; {len(r.refused)} refused by its capability table: {r.refused[0]}"
        lines.append(f"{r.family:<20} {r.passed + r.failed:>6} {r.passed:>7} {r.failed:>7}  {verdict}")
    total = sum(r.passed + r.failed for r in rows)
    failed = sum(r.failed for r in rows)
    lines.append(f"{'total':<20} {total:>6} {total - failed:>7} {failed:>7}  "
                 f"{'pass' if not failed else 'FAIL'}")
    return "\n".join(lines)
