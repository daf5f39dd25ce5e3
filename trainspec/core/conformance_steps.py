"""The conformance suite's step families: an implementation's training steps against the
references the suite ships (trainspec/core/golden.json, from the float64 NumPy reference).

Every family starts from the same parameters (trainspec.core.reference_train.initial_params)
and trains the conformance job for golden.STEPS steps on the shipped batches (ragged masks),
the first at the full learning rate:
- `reference trajectory`: the data layout, once per optimizer of golden.OPTIMIZERS (AdamW;
  SGD, whose update shows the clipping); every step's loss, gradient norm and parameter
  digest against the reference's. Every implementation must run these.
- `accumulation`: 2 and 4 micro-batches; `layout invariance`: fsdp, data x fsdp,
  data x tensor, fsdp x tensor, data x context. Each against the reference, and its UPDATED PARAMETERS against
  the implementation's own data-layout run. A case whose spec the implementation's capability
  table refuses is counted as refused, by its table's line, not run.
- `pipeline`: the conformance job with 2 layers (the shipped trajectories are of 1 layer,
  which no pipeline splits) over a pipeline axis of 2 stages beside the data axis (GPipe, 2
  pipeline micro-batches), against the implementation's own run of that job without a
  pipeline: its losses and UPDATED PARAMETERS. A pipeline moves layers, not the step's result.
  Under SGD, whose update is the (clipped) gradient itself: AdamW's first update is about its
  sign, blind to a micro-batch's gradient counted at the wrong scale, and it turns the float32
  rounding of near-zero gradient elements into parts of a full step (torch, 8 ranks: 1.0e-4 of
  the update under AdamW where SGD's differs by 2.3e-6, as a data x fsdp layout's does).
- `metric records`: a 3-step `trainspec train` writes records that validate against the schema
  and carry the core's numbers (steps, learning rate, tokens, model FLOPs).
"""
from __future__ import annotations

import dataclasses
import tempfile
import traceback
from pathlib import Path

import numpy as np

from trainspec.core import flops, golden as golden_file, reference_train as ref
from trainspec.core.capabilities import Request
from trainspec.core.conformance import Row
from trainspec.core.errors import UserInputError
from trainspec.core.mesh import resolve_mesh
from trainspec.core.records import json_schema, read_jsonl
from trainspec.core.transformer_flops import TransformerFlops

# float32 implementations against the float64 reference, 3 steps (measured worst cases:
# docs/adapters.md, section 3). Loss and gradient norm are sums over 512 tokens; a parameter's
# update is compared as a whole (its L2 norm and projections, relative to its size), because
# Adam turns a gradient element that float32 rounding moves across zero into a full step of
# the other sign.
LOSS_RTOL, NORM_RTOL, UPDATE_RTOL = 1e-5, 1e-5, 5e-4
# The implementation against itself: the same float32 sums in another order.
SELF_RTOL = 1e-4
ACCUMULATION = {"2 micro-batches": ["batch.micro_batch=16"],
                "4 micro-batches": ["batch.micro_batch=8"]}
LAYOUTS = {  # any device count divisible by 4
    "fsdp": ["mesh.axes.data.size=1", "mesh.axes.fsdp.size=-1"],
    "data x fsdp": ["mesh.axes.fsdp.size=2"],
    "data x tensor": ["mesh.axes.tensor.size=2"],
    "fsdp x tensor": ["mesh.axes.data.size=1", "mesh.axes.fsdp.size=-1", "mesh.axes.tensor.size=2"],
    # the ring over a zig-zag split: a causal mask off by one block changes the loss
    "data x context": ["mesh.axes.context.size=2"],
}
PIPELINE_JOB, PIPELINE_OPTIMIZER = ["model.n_layers=2"], "sgd"
PIPELINES = {"pipeline x data": [
    'mesh.axes={stage={role="pipeline",size=2},data={size=-1},fsdp={size=1},tensor={size=1}}',
    'pipeline.schedule="gpipe"', "pipeline.microbatches=2"]}
RECORD_STEPS = 3


def refusal(adapter, spec) -> str | None:
    """The line with which the implementation's capability table refuses `spec` on its
    devices, or None."""
    try:
        dims = resolve_mesh(spec, len(adapter.device_ids()))
    except UserInputError as err:
        return str(err)
    table = getattr(adapter, "capabilities", None)
    if table is None:
        return None  # the capability table row fails it by name
    lines = table.refusals(Request(spec, dims))
    return lines[0] if lines else None


def _train(adapter, spec, params, batches) -> tuple[list | None, str | None]:
    """(the steps, None), or (None, what went wrong) in one line."""
    try:
        return adapter.train_steps(spec, params, batches), None
    except Exception as err:  # one line naming the case, not a traceback
        where = traceback.extract_tb(err.__traceback__)[-1]
        first = str(err).splitlines()[0] if str(err) else ""
        return None, (f"raised {type(err).__name__}: {first} "
                      f"({Path(where.filename).name}:{where.lineno})")


def _relative(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def _update_error(got: list[float], want: list[float]) -> float:
    """How far an update's digest is from the reference's, relative to the update's size:
    its norm's difference, and the projections' RMS difference (about the L2 distance)."""
    g, w = np.asarray(got), np.asarray(want)
    return max(abs(g[0] - w[0]), float(np.sqrt(np.mean((g[1:] - w[1:]) ** 2)))) / max(w[0], 1e-30)


def against_reference(steps: list, want: list[dict], start: dict) -> str | None:
    """The first way the steps differ from the reference's, or None."""
    if len(steps) != len(want):
        return f"{len(steps)} steps returned, {len(want)} run"
    for i, ((loss, norm, params), w) in enumerate(zip(steps, want), 1):
        if not _relative(loss, w["loss"]) <= LOSS_RTOL:
            return f"step {i}: loss {loss:.7g}, reference {w['loss']:.7g}"
        if not _relative(norm, w["grad_norm"]) <= NORM_RTOL:
            return f"step {i}: gradient norm {norm:.7g}, reference {w['grad_norm']:.7g}"
        if ref.leaves(params).keys() != w["digest"].keys():
            return (f"step {i}: parameters {sorted(ref.leaves(params))}, "
                    f"expected {sorted(w['digest'])}")
        got, sizes = ref.digest(params, start), ref.leaves(start)
        for path, digest in w["digest"].items():
            if digest[0] == 0:  # a learning rate of 0 (warm-up's first update)
                moved = got[path][0] / max(float(np.linalg.norm(sizes[path])), 1e-30)
                if not moved <= UPDATE_RTOL:
                    return (f"step {i}: {path} moved {moved:.2g} of its size where the "
                            f"reference leaves it unchanged")
                continue
            error = _update_error(got[path], digest)
            if not error <= UPDATE_RTOL:
                return f"step {i}: {path} updated {error:.2g} of its update away from the reference"
    return None


def against_itself(steps: list, base: list, start: dict) -> str | None:
    """The first step whose updated parameters differ from the data layout's (each parameter's
    update compared as a whole), or None."""
    before = ref.leaves(start)
    for i, ((_, _, params), (_, _, base_params)) in enumerate(zip(steps, base), 1):
        got, want = ref.leaves(params), ref.leaves(base_params)
        for path in want:
            delta = want[path].astype(np.float64) - before[path]
            diff = np.linalg.norm(got[path].astype(np.float64) - want[path])
            if not diff <= SELF_RTOL * np.linalg.norm(delta):
                return (f"step {i}: {path} differs from the data layout's by "
                        f"{diff / np.linalg.norm(delta):.2g} of its update")
    return None


def step_rows(adapter) -> list[Row]:
    shipped, model = golden_file.load(), golden_file.spec().model
    start = ref.initial_params(model, golden_file.spec().seed)
    trajectory = Row("reference trajectory")
    base = {}
    for name in golden_file.OPTIMIZERS:
        spec, steps = golden_file.spec(name), None
        problem = refusal(adapter, spec)
        if problem:  # every implementation must run the conformance job itself
            problem = f"its capability table refuses the conformance job: {problem}"
        else:
            steps, problem = _train(adapter, spec, start, shipped.batches)
        problem = problem or against_reference(steps, shipped.trajectories[name], start)
        problem = next((p for p in adapter.gather_objects(problem) if p), None)
        trajectory.add(problem is None, f"{name}: {problem}")
        base[name] = steps
    rows = [trajectory]
    for family, cases in (("accumulation", ACCUMULATION), ("layout invariance", LAYOUTS)):
        row = Row(family)
        for case, sets in cases.items():
            spec = golden_file.spec("adamw", sets)
            refused = refusal(adapter, spec)
            if refused:
                row.refused.append(f"{case}: {refused}")
                continue
            steps, problem = _train(adapter, spec, start, shipped.batches)
            problem = (problem or against_reference(steps, shipped.trajectories["adamw"], start)
                       or (base["adamw"] and against_itself(steps, base["adamw"], start)))
            problem = next((p for p in adapter.gather_objects(problem) if p), None)
            row.add(problem is None, f"{case}: {problem}")
        rows.append(row)
    return [*rows, pipeline_row(adapter, shipped.batches)]


def _losses_differ(steps: list, base: list) -> str | None:
    for i, ((loss, _, _), (want, _, _)) in enumerate(zip(steps, base), 1):
        if not _relative(loss, want) <= SELF_RTOL:
            return f"step {i}: loss {loss:.7g}, {want:.7g} without the pipeline"
    return None


def pipeline_row(adapter, batches) -> Row:
    row, base = Row("pipeline"), None
    unpipelined = golden_file.spec(PIPELINE_OPTIMIZER, PIPELINE_JOB)
    start = ref.initial_params(unpipelined.model, unpipelined.seed)
    for case, sets in PIPELINES.items():
        spec = golden_file.spec(PIPELINE_OPTIMIZER, [*PIPELINE_JOB, *sets])
        refused = refusal(adapter, spec)
        if refused:
            row.refused.append(f"{case}: {refused}")
            continue
        if base is None:
            base, base_problem = _train(adapter, unpipelined, start, batches)
        steps, problem = _train(adapter, spec, start, batches)
        problem = (problem or (base_problem and f"without the pipeline: {base_problem}")
                   or _losses_differ(steps, base) or against_itself(steps, base, start))
        problem = next((p for p in adapter.gather_objects(problem) if p), None)
        row.add(problem is None, f"{case}: {problem}")
    if row.refused and not row.passed + row.failed:  # an implementation without a pipeline
        row.skipped = f"its capability table refuses every case: {row.refused[0]}"
    return row


def _record_problem(record: dict, spec, step: int) -> str | None:
    """What in the record disagrees with the core's numbers for `spec`'s step `step`."""
    lr = ref.learning_rate(spec.optimizer, spec.train.steps, step - 1)
    model = TransformerFlops(spec.model, spec.batch.seq_len, spec.remat.policy)
    want_flops = model.model_per_token(spec.metrics.flops_convention) * flops.tokens_per_step(spec)
    checks = (("step", record.get("step"), step),
              ("learning_rate", record.get("learning_rate"), lr),
              ("batch_tokens", record.get("batch_tokens"), flops.tokens_per_step(spec)),
              ("model_flops_per_step", record.get("model_flops_per_step"), want_flops))
    for field, got, want in checks:
        if not (isinstance(got, (int, float)) and _relative(got, want) <= 1e-6):
            return f"{field} {got}, the core gives {want}"
    return None


def records_row(adapter) -> Row:
    import jsonschema

    row = Row("metric records")
    spec = golden_file.spec()
    with tempfile.TemporaryDirectory() as tmp:
        shared = Path(adapter.gather_objects(tmp)[0])  # one directory: process 0's (one host)
        adapter.train_run(spec, shared, steps=RECORD_STEPS)
        if adapter.is_writer():
            validator = jsonschema.Draft202012Validator(json_schema())
            records = read_jsonl(shared / spec.metrics.path)
            row.add(len(records) == RECORD_STEPS,
                    f"{len(records)} records of {RECORD_STEPS} steps at metrics.interval = 1")
            for step, record in enumerate(records, 1):
                errors = list(validator.iter_errors(record))
                problem = errors[0].message if errors else _record_problem(record, spec, step)
                row.add(problem is None, f"step {step}: {problem}")
        verdict = adapter.gather_objects(dataclasses.asdict(row))[0]
    return Row(**verdict)
