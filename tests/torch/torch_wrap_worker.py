"""One rank of the wrap tests' jobs (test_torch_wrap.py): nanoGPT's GPT (tests/torch/gpt_model.py)
trained through trainspec.torch.wrap on the ragged batches of the cross-framework test.

Run under `trainspec launch --nprocs N -- python torch_wrap_worker.py JOB.json`. JOB:
- "layouts": {name: spec overrides}: each trained from step 0 for "steps" steps, one after the
  other in the same process group; rank 0 writes {name: losses} to "out". Then a bit of rank 1's
  copy of the first parameter of the "bitflip" layout is flipped, and what the replica check
  says is written under "replica_check";
- or "resume": spec overrides, with "run_dir": train to "steps" from the newest checkpoint
  there (saving at checkpoint.interval); rank 0 appends "step loss" lines to "out", the first
  line "resumed_from N". With "stall_after": S, every rank sleeps after step S and its saves (to be
  killed), rank 0 first writing "stalled" once the saves are complete.
"""
import json
import sys
import time
from pathlib import Path

import torch

import trainspec.torch
from gpt_model import GPT, GPTConfig, adamw, token_loss
from trainspec.core.conformance_runner import ragged_batch
from trainspec.core.data import ByteBatches
from trainspec.core.health import ReplicaMismatch
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec


def wrapped(overrides):
    spec = load_spec(DEFAULT_SPEC_PATH, overrides)
    step = trainspec.torch.wrap(lambda: GPT(GPTConfig()), token_loss, spec, optimizer_fn=adamw)
    return spec, step, ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed)


def train_layouts(job) -> None:
    results = {}
    for name, overrides in job["layouts"].items():
        _, step, data = wrapped(overrides)
        results[name] = [step(ragged_batch(data, i))["loss"] for i in range(job["steps"])]
        if name == job["bitflip"]:
            results["replica_check"] = corrupted_replica_check(step, job["steps"])
    if step.mesh.get_rank() == 0:
        Path(job["out"]).write_text(json.dumps(results))


def corrupted_replica_check(step, step_number: int) -> dict | None:
    """Flip bit 20 of the first element of rank 1's first parameter; the replica check's verdict."""
    if step.mesh.get_rank() == 1:
        with torch.no_grad():
            step.params[0].view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
    try:
        step.check_replicas(step_number)
    except ReplicaMismatch as mismatch:
        return {"message": str(mismatch), "ranks": mismatch.devices}
    return None


def resume(job) -> None:
    spec, step, data = wrapped(job["resume"])
    checkpoints = trainspec.torch.TorchCheckpointer(spec, Path(job["run_dir"]))
    position = step.restore(checkpoints)
    writer = checkpoints.writer
    out = open(job["out"], "a") if writer else None
    if writer:
        print(f"resumed_from {position}", file=out, flush=True)
    for i in range(position, job["steps"]):
        loss = step(ragged_batch(data, i))["loss"]
        if writer:
            print(f"{i + 1} {loss!r}", file=out, flush=True)
        if checkpoints.due(i + 1, job["steps"]):
            step.save(checkpoints, i + 1)
        if i + 1 == job.get("stall_after"):
            checkpoints.wait()  # the background save done: the kill comes after it
            if writer:
                print("stalled", file=out, flush=True)
            time.sleep(3600)
    checkpoints.wait()  # checkpoint.async_save: the last save complete before the job ends


if __name__ == "__main__":
    job = json.loads(Path(sys.argv[1]).read_text())
    (resume if "resume" in job else train_layouts)(job)
