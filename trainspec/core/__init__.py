"""The spec itself, framework-free: this package imports neither jax nor torch (nor flax, optax).

An implementation of trainspec (the JAX one in trainspec.jax, or another framework's) builds on it:

- `spec`: the schema (pydantic), defaults, validation, `load_spec`; `errors.UserInputError`;
  `schema`: `python -m trainspec.core.schema [spec|metrics]` prints the JSON Schemas.
- `mesh`: the mesh in plain integers: `resolve_mesh` gives the `ParallelDims` of a device
  count (axis sizes, roles, dcn factors, degrees: the one object the steps and the planner read),
  `place_devices` (device ids laid out in the mesh, excluded devices removed, processes as
  dcn blocks) and `PlacedMesh.groups(axes)` (the rank groups of a collective over `axes`).
- `accumulation`: the token-weighted accumulation rule and its float64 reference.
- `data`: the default job's batches, a pure function of (seed, step).
- `records`: the metrics record schema, `JsonlWriter` and `read_jsonl`; `flops`: FLOPs
  conventions, peak table and `utilisation` (MFU/HFU); `cpu_peak`: the measured CPU peak every
  implementation divides by; `goodput`: the goodput/badput account.
- `loop`, `run`: the training loop of every implementation (the `Step` and `Checkpointer`
  protocols an implementation fills, and `Run`, the run services around any loop); `recorder`
  builds the records, `sinks` writes them (JSONL, TensorBoard); `faults`: the fault hooks;
  `user_model`: what `trainspec train --model` trains.
- `health`: the NaN policy state machine, the replica fingerprint vote, the straggler rule, and
  the exceptions a guard raises (`HealthHalt`, `ReplicaMismatch`).
- `collectives_reference`: float64 references, adjoints and tolerances of the six collectives;
  `conformance`: the layouts and cases every collectives implementation must pass.
- `capabilities`: the capability table (what an implementation does with every spec field).
- `reference_model`, `reference_train`: the reference job in NumPy (loss and gradient by hand,
  initial parameters, schedule, clipping, optimizers); `golden`: the conformance suite's shipped
  references, computed by them in float64; `conformance_runner`, `conformance_steps`: the suite;
  `simulated`: devices simulated in one process (a NumPy implementation's, the case counts').
- `gns`: the gradient noise scale estimator; `advice`, `scaling`: the planner's formulas.

tests/core/test_core.py imports every module here with framework imports refused; an import-linter
contract (pyproject.toml) keeps it so.
"""
