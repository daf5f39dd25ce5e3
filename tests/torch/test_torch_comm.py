"""The torch records' communication volume (trainspec/torch/comm.py; docs/metrics.md section 5)
against the analytic volumes of the reference model (P = its float32 parameter bytes), on 4
gloo ranks of data 2 x fsdp 2: FSDP2's reduce-scatter of the gradient on `fsdp` is P, its
all-gathers between P (once per step) and 2P (again in backward), the data all-reduce of each
rank's half-shard P/2 plus the step's few scalars; the bus bytes follow nccl-tests' factors.
(Data parallel alone: one all-reduce of P plus scalars, in test_torch_train.py.)"""

import pytest

from cli_runs import read_records, run_cli_ok, train_command
from tiny import TINY, tiny_spec
from trainspec.torch.models.transformer import Transformer

pytestmark = pytest.mark.slow  # two torch jobs (4 ranks, 2 ranks): over a minute on 2 cores

SCALARS = 64  # bytes of loss sums, token counts and the like, at most


def test_data_by_fsdp_counts_the_gradient_collectives(tmp_path):
    sets = [*TINY, "mesh.axes.data.size=2", "mesh.axes.fsdp.size=2", "checkpoint.interval=0",
            "metrics.interval=1"]
    run_cli_ok(train_command(tmp_path, sets, steps=2, framework="torch", nprocs=4, summary=False))
    p = 4 * sum(x.numel() for x in Transformer(tiny_spec().model).parameters())
    records = read_records(tmp_path)
    assert records[0]["comm_bytes_by_kind"] == records[-1]["comm_bytes_by_kind"]  # every step
    kind, axis = records[-1]["comm_bytes_by_kind"], records[-1]["comm_bytes_by_axis"]
    assert kind["reduce-scatter"] == p
    assert p < kind["all-gather"] < 2 * p
    assert p // 2 <= kind["all-reduce"] <= p // 2 + SCALARS
    gathers = kind["reduce-scatter"] + kind["all-gather"]
    assert gathers <= axis["fsdp"] <= gathers + SCALARS
    assert p // 2 <= axis["data"] <= p // 2 + SCALARS
    assert records[-1]["comm_bytes_per_step"] == sum(kind.values())
    bus = gathers * (2 - 1) / 2 + axis["data"] * 2 * (2 - 1) / 2  # n = 2 on either axis
    assert abs(records[-1]["comm_bus_bytes_per_step"] - bus) <= 3 * SCALARS


def test_the_context_rings_sends_are_counted_on_the_context_axis(tmp_path):
    """Context 2 (ring) on 2 ranks: each block's attention sends its keys and values once to
    the next rank forward (n - 1 = 1 ring step) and their gradients once back, each a
    (rows, heads, seq_len / 2, 2 head_dim) float32 buffer; counted as collective-permutes on
    `context`, which also carries the gradient all-reduce."""
    sets = [*TINY, "mesh.axes.data.size=1", "mesh.axes.context.size=2", "checkpoint.interval=0",
            "metrics.interval=1"]
    run_cli_ok(train_command(tmp_path, sets, steps=1, framework="torch", nprocs=2, summary=False))
    model = tiny_spec().model
    rows, seq = tiny_spec().batch.global_batch, tiny_spec().batch.seq_len
    sends = model.n_layers * 2 * rows * model.n_heads * (seq // 2) * 2 * (
        model.d_model // model.n_heads) * 4
    record = read_records(tmp_path)[-1]
    assert record["comm_bytes_by_kind"]["collective-permute"] == sends
    assert record["comm_bytes_by_axis"]["context"] > sends  # and the gradient all-reduce
