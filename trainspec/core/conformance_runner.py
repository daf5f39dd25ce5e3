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
- `accumulation`: one step with the batch in 4 micro-batches equals one step in 1, on ragged
  masks (where the mean of micro-batch means would not);
- `layout invariance`: one step under data, fsdp and tensor layouts equals the data layout's;
- `metric records`: a short `trainspec train` writes records that validate against
  trainspec/core/metrics.schema.json.
Framework-free: it calls only the interface (trainspec/core/adapter.py).
"""
from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path

import numpy as np

from trainspec.core.adapter import GUARANTEES, Adapter
from trainspec.core import conformance as cases
from trainspec.core.records import json_schema, read_jsonl
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.core.data import ByteBatches

# The tiny reference job of the step families (seconds on a CPU).
TINY = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.n_heads=4",
        "batch.seq_len=16", "batch.global_batch=32", "metrics.interval=1",
        "optimizer.warmup_steps=0", "checkpoint.interval=0"]
STEP_RTOL, STEP_ATOL = 1e-5, 1e-7  # float32 steps whose sums differ in order only
# `--quick`: a group of all 8 and groups of 3 of 6 devices; a 32-bit float, a 16-bit float
# (accumulated in float32) and an integer.
QUICK_LAYOUTS, QUICK_DTYPES = ("grid", "rows3"), ("float32", "bfloat16", "int32")
# Layouts of one step compared with the data layout (any device count divisible by 4).
LAYOUTS = {
    "fsdp": ["mesh.axes.data.size=1", "mesh.axes.fsdp.size=-1"],
    "data x fsdp": ["mesh.axes.fsdp.size=2"],
    "data x tensor": ["mesh.axes.tensor.size=2"],
    "fsdp x tensor": ["mesh.axes.data.size=1", "mesh.axes.fsdp.size=-1", "mesh.axes.tensor.size=2"],
}


@dataclasses.dataclass
class Row:
    family: str
    passed: int = 0
    failed: int = 0
    first_failure: str = ""
    skipped: str = ""  # why the family does not apply to the implementation

    def add(self, ok: bool, what: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            self.first_failure = self.first_failure or what


def ragged_batch(data: ByteBatches, step: int) -> dict[str, np.ndarray]:
    """Batch `step` with a ragged mask: each sequence keeps a random prefix of >= 2 tokens."""
    batch = data.batch(step)
    rng = np.random.default_rng([data.seed, step, 1])
    lengths = rng.integers(2, data.seq_len + 1, data.global_batch)
    batch["mask"] = (np.arange(data.seq_len) < lengths[:, None]).astype(np.float32)
    return batch


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


# -- the step families --------------------------------------------------------------------------

def _close(a: dict, b: dict) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return np.allclose(np.asarray(a), np.asarray(b), rtol=STEP_RTOL, atol=STEP_ATOL)


def _step_rows(adapter: Adapter) -> list[Row]:
    base = load_spec(DEFAULT_SPEC_PATH, TINY + ["batch.micro_batch=32"])
    params = adapter.initial_params(base)
    batch = ragged_batch(ByteBatches(base.batch.seq_len, base.batch.global_batch, base.seed), 0)
    loss, after = adapter.one_step(base, params, batch)
    accumulation = Row("accumulation")
    for k in (2, 4):
        spec = load_spec(base, [f"batch.micro_batch={32 // k}"])
        loss_k, after_k = adapter.one_step(spec, params, batch)
        accumulation.add(np.isclose(loss_k, loss, rtol=STEP_RTOL) and _close(after_k, after),
                         f"{k} micro-batches: loss {loss_k} vs {loss}")
    layouts = Row("layout invariance")
    for name, sets in LAYOUTS.items():
        loss_l, after_l = adapter.one_step(load_spec(base, sets), params, batch)
        layouts.add(np.isclose(loss_l, loss, rtol=STEP_RTOL) and _close(after_l, after),
                    f"{name}: loss {loss_l} vs {loss}")
    return [accumulation, layouts]


def _records_row(adapter: Adapter) -> Row:
    import jsonschema

    row = Row("metric records")
    spec = load_spec(DEFAULT_SPEC_PATH, TINY)
    with tempfile.TemporaryDirectory() as tmp:
        shared = adapter.gather_objects(tmp)[0]  # one directory: process 0's (one host)
        adapter.train_run(spec, Path(shared), steps=3)
        if adapter.is_writer():
            validator = jsonschema.Draft202012Validator(json_schema())
            for record in read_jsonl(Path(shared) / spec.metrics.path):
                errors = list(validator.iter_errors(record))
                row.add(not errors, f"step {record.get('step')}: {errors[0].message if errors else ''}")
        verdict = adapter.gather_objects(dataclasses.asdict(row))[0]
    return Row(**verdict)


def run(adapter: Adapter, quick: bool = False) -> list[Row]:
    """Every family's row; `quick` runs the collectives on QUICK_LAYOUTS and QUICK_DTYPES only."""
    return [*_collective_rows(adapter, quick), _special_row(adapter), _illegal_row(adapter),
            _guarantee_row(adapter), *_compression_rows(adapter),
            *_step_rows(adapter), _records_row(adapter)]


def table(impl: str, rows: list[Row]) -> str:
    lines = [f"conformance of {impl}", f"{'family':<20} {'cases':>6} {'passed':>7} {'failed':>7}  verdict"]
    for r in rows:
        if r.skipped:
            lines.append(f"{r.family:<20} {'-':>6} {'-':>7} {'-':>7}  skipped: {r.skipped}")
            continue
        verdict = "pass" if not r.failed else f"FAIL: {r.first_failure}"
        lines.append(f"{r.family:<20} {r.passed + r.failed:>6} {r.passed:>7} {r.failed:>7}  {verdict}")
    total = sum(r.passed + r.failed for r in rows)
    failed = sum(r.failed for r in rows)
    lines.append(f"{'total':<20} {total:>6} {total - failed:>7} {failed:>7}  "
                 f"{'pass' if not failed else 'FAIL'}")
    return "\n".join(lines)
