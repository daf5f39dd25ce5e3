"""One rank of test_torch_pipeline_schedule.py, under `trainspec launch --nprocs 2`: the second
step of the reference model over pipeline 2 (m = 8 pipeline micro-batches, VIRTUAL chunks per
stage, one layer each) under SCHEDULE, then the
operations this rank's stage ran (trainspec.torch.pipeline.ExecutedOrder) gathered to rank 0,
which prints them as JSON: per stage, [kind, micro-batch, chunk] in order, the
micro-batches of activations held after each, and the bytes held for the backwards at the
start of each and at the step's end."""
import json
import sys

import numpy as np
import torch.distributed as dist

from trainspec.core.data import ByteBatches
from trainspec.core.spec import load_spec
from trainspec.torch.runtime import TorchRuntime
from trainspec.torch.train import TorchStep

schedule, virtual = sys.argv[1], int(sys.argv[2])
spec = load_spec(None, [
    "model.d_model=16", "model.d_ff=32", f"model.n_layers={2 * virtual}", "model.n_heads=2",
    "batch.seq_len=8", "batch.global_batch=8", "batch.micro_batch=8", "eval.interval=0",
    'mesh.axes={stage={role="pipeline",size=2},data={size=1},fsdp={size=1},tensor={size=1}}',
    f'pipeline.schedule="{schedule}"', "pipeline.microbatches=8",
    f"pipeline.virtual_stages={virtual}"])


def executed_order(runtime: TorchRuntime) -> dict:
    """This rank's record of the second step. A function, so that the step (its mesh, stages
    and groups) is freed before the job is left: TorchRuntime.leave says why."""
    step = TorchStep(spec, runtime.build_mesh(spec), 1, runtime.device)
    batch = ByteBatches(spec.batch.seq_len, spec.batch.global_batch, spec.seed).batch(0)
    rows = {key: np.asarray(v)[step.rows()] for key, v in batch.items()}
    step(rows)  # the first step's schedule also infers the stages' shapes, with its own forward
    executed = step.pipeline.executed
    executed.measure_bytes = True
    step(rows)  # its record replaces the first step's
    return {"ops": [[op.kind, op.microbatch, op.chunk] for op, _, _ in executed.ops],
            "held": executed.held, "held_bytes": executed.held_bytes}


runtime = TorchRuntime()
runtime.join()
every = [None] * dist.get_world_size()
dist.all_gather_object(every, executed_order(runtime))
if dist.get_rank() == 0:
    print("EXECUTED " + json.dumps(every), flush=True)
runtime.leave()
