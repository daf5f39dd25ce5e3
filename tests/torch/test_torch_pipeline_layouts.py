"""The torch pipeline on four stages, interleaved, and a user's model through
`trainspec.torch.wrap` with its split points named (docs/wrapping.md, "Pipeline"), in one job
of 8 gloo ranks (tests/torch/torch_pipeline_layouts_worker.py): 10 float32 steps of each layout
from the same seeded parameters, the per-step loss and gradient norm, and the trained model's
evaluated loss (a forward through every stage in turn), within 1e-5 of the same model without a
pipeline (data 8). The reference model (4 layers) runs pipeline 2 x data 4 and pipeline 4 x
data 2 under GPipe, pipeline 4 x fsdp 2 under 1F1B with 8 micro-batches (its steady state
alternating), and pipeline 2 x fsdp 2 x data 2 under interleaved 1F1B (2 chunks of one layer
per stage, each its own FSDP2 root);
the user's model (4 residual blocks) runs pipeline 2 x fsdp 2 x data 2 under 1F1B, pipeline 4
x data 2 under GPipe and pipeline 2 x data 4 under interleaved 1F1B (m = 4). Gradients are
clipped at 1.0 from the first step, so a lost micro-batch or a stage applied twice changes
every update."""
import json
from pathlib import Path

import numpy as np
import pytest

from rank_jobs import launch_worker
from trainspec.core.errors import UserInputError
from trainspec.core.spec import load_spec
from trainspec.torch.pipeline import stage_pipeline
from trainspec.torch.support import check_layout
from tiny import TINY

pytest.importorskip("torch", reason="the torch extra")

HERE = Path(__file__).resolve().parent
STEPS, RTOL = 10, 1e-5


def mesh(pipeline: int, data: int, fsdp: int, schedule: str) -> list[str]:
    return [f'mesh.axes={{stage={{role="pipeline",size={pipeline}}},data={{size={data}}},'
            f'fsdp={{size={fsdp}}},tensor={{size=1}}}}', f'pipeline.schedule="{schedule}"']


FLAT = ["mesh.axes.data.size=8", "mesh.axes.fsdp.size=1", "mesh.axes.tensor.size=1"]
REFERENCE = [*TINY, "model.n_layers=4", "eval.interval=0", "checkpoint.interval=0"]
USER = ["model.n_layers=4", "batch.global_batch=16", "batch.micro_batch=16",
        "optimizer.warmup_steps=2", "metrics.gns=false", "eval.interval=0"]
JOB = {
    "reference": {"flat": [*REFERENCE, *FLAT],
                  "pipeline2_data4_gpipe": [*REFERENCE, *mesh(2, 4, 1, "gpipe")],
                  "pipeline4_data2_gpipe": [*REFERENCE, *mesh(4, 2, 1, "gpipe")],
                  "pipeline4_fsdp2_1f1b_m8": [*REFERENCE, *mesh(4, 1, 2, "1f1b"),
                                              "pipeline.microbatches=8"],
                  "pipeline2_fsdp2_data2_interleaved_v2": [
                      *REFERENCE, *mesh(2, 2, 2, "interleaved_1f1b"),
                      "pipeline.virtual_stages=2"]},
    "user": {"flat": [*USER, *FLAT],
             "pipeline2_fsdp2_data2_1f1b": [*USER, *mesh(2, 2, 2, "1f1b")],
             "pipeline4_data2_gpipe": [*USER, *mesh(4, 2, 1, "gpipe")],
             "pipeline2_data4_interleaved_v2_m4": [*USER, *mesh(2, 4, 1, "interleaved_1f1b"),
                                                   "pipeline.virtual_stages=2",
                                                   "pipeline.microbatches=4"]},
}


@pytest.fixture(scope="module")  # one 8-rank job, every layout trained in it
def trained(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("pipeline_layouts")
    out = tmp / "trajectories.json"
    (tmp / "job.json").write_text(json.dumps({**JOB, "steps": STEPS, "out": str(out)}))
    launch_worker(HERE / "torch_pipeline_layouts_worker.py", tmp / "job.json", 8)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [(family, name) for family, layouts in JOB.items()
                                            for name in layouts if name != "flat"])
def test_ten_pipelined_steps_equal_the_run_without_a_pipeline(trained, family, layout):
    got, want = trained[family][layout], trained[family]["flat"]
    assert len(got["loss"]) == STEPS
    for quantity in ("loss", "grad_norm", "evaluated"):
        g, w = np.array(got[quantity]), np.array(want[quantity])
        print(f"{family} {layout} vs flat, {quantity}: largest relative difference "
              f"{np.max(np.abs(g - w) / np.abs(w)):.2e}")
        np.testing.assert_allclose(g, w, rtol=RTOL, err_msg=f"{family} {layout} {quantity}")


@pytest.mark.parametrize("blocks, keep_stage, io, missing", [
    (False, True, True, "blocks"), (True, False, True, "keep_stage"),
    (True, True, False, "pipeline_io"), (False, False, False, "blocks, keep_stage, pipeline_io")])
def test_a_model_without_its_split_points_is_refused_naming_what_it_lacks(
        blocks, keep_stage, io, missing):
    import torch

    model = torch.nn.Linear(2, 2)
    if blocks:
        model.blocks = torch.nn.ModuleDict()
    if keep_stage:
        model.keep_stage = lambda layers, first, last: None
    spec = load_spec(None, [*USER, *mesh(2, 1, 1, "1f1b")])
    with pytest.raises(UserInputError, match=rf"^mesh\.axes\.\*\.size: .* missing {missing} "):
        stage_pipeline(spec, check_layout(spec, 2), None, torch.device("cpu"), model,
                       object() if io else None)


def test_wrap_refuses_a_schedule_its_pipeline_does_not_run_by_name():
    # the layout check every wrapped step makes, a user's model or the reference one
    with pytest.raises(UserInputError, match=r"^pipeline\.schedule: .*not 'zero_bubble_v'"):
        check_layout(load_spec(None, [*USER, *mesh(2, 2, 1, "zero_bubble_v")]), 4)
