"""The MoE reference model on 4 gloo ranks, from the same seeded draws, on ragged batches:
with dropless routing, expert 4, expert 2 x data 2, expert 2 x fsdp 2 (FSDP2 shards all but
the experts' kernels) and expert 2 x context 2 give the losses and gradient norms of data 4
(the experts whole on every rank) within 1e-5 over 10 steps; with capacity-limited routing
the dropped assignments are counted, the same on every layout (expert 2 x tensor 2, attention
tensor parallel and the experts whole over tensor, among them), and the losses agree; a
router whose drop order is reversed (later rows first) misses the tolerance; the routing
statistics are reported per step as JAX's (trainspec.core.records.moe_fields reads them)."""
import numpy as np
import pytest

from cli_runs import read_records, read_summary, run_cli_ok, train_command
from sequence_job import run_layouts
from tiny import TINY

pytestmark = pytest.mark.slow

STEPS, RTOL = 10, 1e-5
MOE = [*TINY, "model.moe.experts=4", "model.moe.top_k=2", "model.n_layers=2",
       "batch.global_batch=8", "batch.micro_batch=8", "optimizer.grad_clip_norm=1.0"]
LIMITED = "model.moe.capacity_factor=0.5"
EXPERT4 = ["mesh.axes.data.size=1", "mesh.axes.expert.size=4"]
EXPERT2 = ["mesh.axes.data.size=2", "mesh.axes.expert.size=2"]
EXPERT2_FSDP2 = ["mesh.axes.data.size=1", "mesh.axes.fsdp.size=2", "mesh.axes.expert.size=2"]
LAYOUTS = {"data4": [], "expert4": EXPERT4, "expert2_data2": EXPERT2,
           "expert2_fsdp2": EXPERT2_FSDP2,
           "expert2_context2": ["mesh.axes.data.size=1", "mesh.axes.context.size=2",
                                "mesh.axes.expert.size=2"],
           "data4_limited": [LIMITED], "expert4_limited": [*EXPERT4, LIMITED],
           "expert2_data2_limited": [*EXPERT2, LIMITED],
           "expert2_tensor2_limited": ["mesh.axes.data.size=1", "mesh.axes.tensor.size=2",
                                      "mesh.axes.expert.size=2", LIMITED],
           "broken_router": [*EXPERT4, LIMITED]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("moe"),
                       {name: [*MOE, *sets] for name, sets in LAYOUTS.items()}, STEPS,
                       broken={"broken_router": "router_drops_earlier_rows"})


def _close(got, want, key):
    got, want = np.array(got), np.array(want)
    print(f"{key}: largest relative difference {np.max(np.abs(got - want) / np.abs(want)):.2e}")
    np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=key)


@pytest.mark.parametrize("layout,like", [("expert4", "data4"), ("expert2_data2", "data4"),
                                         ("expert2_fsdp2", "data4"), ("expert2_context2", "data4"),
                                         ("expert4_limited", "data4_limited"),
                                         ("expert2_data2_limited", "data4_limited"),
                                         ("expert2_tensor2_limited", "data4_limited")])
def test_expert_parallel_equals_experts_whole(runs, layout, like):
    for key in ("loss", "grad_norm", "moe_balance", "moe_z"):
        _close(runs[layout][key], runs[like][key], f"{layout} {key}")
    assert runs[layout]["moe_dropped"] == runs[like]["moe_dropped"]
    assert runs[layout]["moe_load"] == runs[like]["moe_load"]
    assert runs[layout]["loss"][-1] < runs[layout]["loss"][0]


def test_dropless_drops_nothing_and_capacity_drops_some(runs):
    assert runs["data4"]["moe_dropped"] == [0.0] * STEPS
    assert all(d > 0 for d in runs["data4_limited"]["moe_dropped"])
    load = np.array(runs["data4"]["moe_load"])  # (steps, layers, experts)
    # every (token, choice) assignment lands on one expert: 8 x 16 tokens x top_k 2 per layer
    assert load.shape == (STEPS, 2, 4) and (load.sum(-1) == 8 * 16 * 2).all()


def test_a_router_dropping_the_wrong_tokens_misses_the_tolerance(runs):
    first, want = runs["broken_router"]["loss"][0], runs["data4_limited"]["loss"][0]
    assert runs["broken_router"]["moe_dropped"][0] == runs["data4_limited"]["moe_dropped"][0]
    assert abs(first - want) > 10 * RTOL * abs(want)


def test_the_train_command_records_the_expert_fields_once(tmp_path):
    """`trainspec train --framework torch` with experts over an expert axis (2 ranks, the
    experts split in two): every record has the expert fields, and the raw sums they are made
    of are not in its `aux` again; the summary gives the all-to-alls' bytes on the expert
    axis."""
    run_dir = tmp_path / "run"
    expert2 = ["mesh.axes.data.size=1", "mesh.axes.expert.size=2"]
    run_cli_ok(train_command(run_dir, [*MOE, *expert2, LIMITED, "metrics.interval=1",
                                       "checkpoint.interval=0"], steps=2, framework="torch",
                             nprocs=2))
    for record in read_records(run_dir):
        assert record["moe_dropped_tokens"] > 0 and record["moe_load_max_over_mean"] >= 1
        assert record["moe_load_balance_loss"] > 0 and record["moe_z_loss"] > 0
        assert "aux" not in record, record["aux"]
    assert read_summary(run_dir)["comm_bytes_by_axis"]["expert"] > 0
