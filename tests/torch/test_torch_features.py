"""The torch step's remat, ZeRO-1, compression and GNS on 4 gloo ranks, from JAX's initial
parameters on the same ragged batches as tests/torch/test_torch_equality.py, against references:

- remat.policy (full, dots_with_no_batch_dims_saveable under data x fsdp, dots_saveable under
  data x tensor) gives the losses of no remat bit for bit: it changes what is kept, not the
  arithmetic (what it recomputes: tests/torch/test_torch_wrap_checks.py);
- layout.optimizer_state = "shard_over_data" gives like_params' losses bit for bit under data,
  data x fsdp and data x tensor, with 1/replicas of the optimizer state bytes on each rank; its
  checkpoint resumes under like_params on another layout;
- collectives.compression bf16 and int8 with error feedback follow JAX's compressed runs (the
  same packing order, chunks and int8 blocks: trainspec.torch.train.TorchStep.packing_order),
  int8 100x closer than it follows the uncompressed run; the compressed sum of one buffer is
  JAX's bit for bit, and the residuals' sum survives a checkpoint; a save changes nothing in
  the run that saved;
- metrics.gns: the per-step parts gns_grad_sq and gns_trace of JAX's step, over replicas
  (data = 4) and over micro-batches (fsdp = 4, 2 micro-batches).
"""
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_reference import jax_trajectory
from rank_jobs import launch_worker
from trainspec.core import compression as ref
from trainspec.core.spec import DEFAULT_SPEC_PATH
from trainspec.jax.collectives import compression as jc
from tiny import TINY

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
STEPS, RANKS, AT = 8, 4, 4
SETS = [*TINY, "optimizer.grad_clip_norm=1.0"]  # clipping active from the first step
DATA2 = ["mesh.axes.data.size=2"]
FSDP2, TENSOR2 = [*DATA2, "mesh.axes.fsdp.size=2"], [*DATA2, "mesh.axes.tensor.size=2"]
ZERO, MICRO = "layout.optimizer_state=shard_over_data", "batch.micro_batch=8"
BF16, INT8 = 'collectives.compression="bf16"', 'collectives.compression="int8"'
INT8_BLOCK = "collectives.compression_block=32"  # several blocks per parameter
FSDP4 = ["mesh.axes.data.size=1", "mesh.axes.fsdp.size=4"]
# both frameworks, on 4 devices / ranks
SHARED = {"data": [], "bf16": [BF16], "int8": [INT8, INT8_BLOCK], "micro": [*FSDP4, MICRO]}
TORCH_ONLY = {
    "data_remat": ["remat.policy=full"],
    "fsdp2": FSDP2, "fsdp2_remat": [*FSDP2, "remat.policy=dots_with_no_batch_dims_saveable"],
    "tensor2": TENSOR2, "tensor2_remat": [*TENSOR2, "remat.policy=dots_saveable"],
    "data_zero": [ZERO], "fsdp2_zero": [*FSDP2, ZERO], "tensor2_zero": [*TENSOR2, ZERO],
}
RESUMES = {
    "zero_to_fsdp2": {"first": [ZERO], "then": FSDP2, "at": AT},
    "int8": {"first": [INT8, INT8_BLOCK], "then": [INT8, INT8_BLOCK], "at": AT},
}
SUM_CASES = [("bf16", 4, True), ("int8", 32, True), ("int8", 4, False)]


def _gradient_like(size, scale, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_t(3, size) * scale * 10.0 ** rng.uniform(-3, 0, size)).astype(np.float32)


@pytest.fixture(scope="module")
def sum_inputs():
    size = 301  # not a multiple of replicas x block: the chunks are padded
    return (np.stack([_gradient_like(size, 1.0, i) for i in range(RANKS)]),
            np.stack([_gradient_like(size, 0.01, 10 + i) for i in range(RANKS)]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sum_inputs):
    tmp = tmp_path_factory.mktemp("features")
    jax_runs = {name: jax_trajectory([*SETS, *sets], STEPS, RANKS)
                for name, sets in SHARED.items()}
    np.savez(tmp / "params.npz", **jax_runs["data"][0])
    np.savez(tmp / "inputs.npz", x=sum_inputs[0], residuals=sum_inputs[1])
    layouts = {name: [*SETS, *sets] for name, sets in {**SHARED, **TORCH_ONLY}.items()}
    resumes = {name: {**r, "first": [*SETS, *r["first"]], "then": [*SETS, *r["then"]]}
               for name, r in RESUMES.items()}
    job = {"spec": str(DEFAULT_SPEC_PATH), "params": str(tmp / "params.npz"), "steps": STEPS,
           "out": str(tmp / "torch.json"), "dir": str(tmp), "layouts": layouts,
           "resumes": resumes, "inputs": str(tmp / "inputs.npz"), "compressed_sums": SUM_CASES}
    (tmp / "job.json").write_text(json.dumps(job))
    launch_worker(HERE / "torch_features_worker.py", tmp / "job.json", RANKS, timeout=900)
    return {name: record for name, (_, record) in jax_runs.items()}, json.loads(
        (tmp / "torch.json").read_text())


def _worst(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want) / np.abs(want)))


@pytest.mark.parametrize("remat,like", [("data_remat", "data"), ("fsdp2_remat", "fsdp2"),
                                        ("tensor2_remat", "tensor2")])
def test_remat_changes_no_number(runs, remat, like):
    layouts = runs[1]["layouts"]
    for key in ("loss", "grad_norm"):
        assert layouts[remat][key] == layouts[like][key], key


@pytest.mark.parametrize("zero,like,replicas", [("data_zero", "data", 4),
                                                ("fsdp2_zero", "fsdp2", 2),
                                                ("tensor2_zero", "tensor2", 2)])
def test_zero1_same_trajectory_a_replica_share_of_the_state(runs, zero, like, replicas):
    layouts = runs[1]["layouts"]
    for key in ("loss", "grad_norm"):
        assert layouts[zero][key] == layouts[like][key], key
    for sharded, whole in zip(layouts[zero]["state_bytes"], layouts[like]["state_bytes"]):
        # each parameter's slice is ceil(n / replicas) elements: 4 bytes x 2 states of padding
        assert whole / replicas <= sharded <= whole / replicas + 8 * 2 * 16, (sharded, whole)


@pytest.mark.parametrize("resume,like", [("zero_to_fsdp2", "data_zero"), ("int8", "int8")])
def test_a_save_changes_nothing_in_the_run_that_saved(runs, resume, like):
    """A save reads the state (ZeRO-1 gathers it, compression adds the residual) and leaves it
    as it was: the saving run goes on as if it had not saved, bit for bit."""
    assert runs[1]["resumes"][resume]["saver"]["loss"] == runs[1]["layouts"][like]["loss"][AT:]


def test_zero1_checkpoint_resumes_on_another_layout_like_params(runs):
    resumed = runs[1]["resumes"]["zero_to_fsdp2"]
    assert resumed["restored_at"] == AT
    uninterrupted = runs[1]["layouts"]["data_zero"]["loss"][AT:]
    # data x fsdp sums in another order than data: 7e-8 measured
    np.testing.assert_allclose(resumed["loss"], uninterrupted, rtol=1e-6)


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_compressed_runs_follow_jax_compressed(runs, compression):
    """Within what the frameworks' float32 sums differ by uncompressed (1.6e-6,
    docs/results.md, "Cross-framework equality"): measured 9e-7 (bf16) and 1.3e-6 (int8)."""
    jax_runs, layouts = runs[0], runs[1]["layouts"]
    to_jax = _worst(layouts[compression]["loss"], jax_runs[compression]["loss"])
    print(f"{compression}: largest relative loss difference to JAX's {to_jax:.2e}")
    assert to_jax <= 1e-5


def test_int8_blocks_are_jaxs(runs):
    """int8 moves this run 100x further from the uncompressed one (1.4e-4) than from JAX's
    int8 run; packed in named_parameters() order (other blocks and chunks) instead of the JAX
    step's order, torch's int8 run lands 1.4e-4 from JAX's. (bf16 rounds each element alone:
    its run is 2.2e-6 from the uncompressed one, within the frameworks' differences; the
    exchange itself is JAX's bit for bit, below.)"""
    jax_runs, torch_int8 = runs[0], runs[1]["layouts"]["int8"]["loss"]
    to_jax, to_uncompressed = (_worst(torch_int8, jax_runs[name]["loss"])
                               for name in ("int8", "data"))
    assert to_uncompressed >= 10 * to_jax, (to_uncompressed, to_jax)


def test_compressed_sum_is_jaxs_bit_for_bit(runs, sum_inputs):
    x, r = sum_inputs
    mesh = jax.make_mesh((RANKS,), ("data",), devices=jax.devices()[:RANKS])
    split = jax.sharding.NamedSharding(mesh, P("data"))
    for (compression, block, feedback), per_rank in zip(SUM_CASES, runs[1]["compressed_sums"]):
        def body(xl, rl):
            total, new = jc.compressed_sum(xl[0], rl[0] if feedback else None, "data", RANKS,
                                           compression, block)
            return total[None], (rl if new is None else new[None])

        total, residual = (np.asarray(a) for a in jax.jit(jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data"))))(
            jax.device_put(x, split), jax.device_put(r, split)))
        for rank, (got_total, got_residual) in enumerate(per_rank):
            np.testing.assert_array_equal(np.float32(got_total), total[rank])
            if feedback:
                np.testing.assert_array_equal(np.float32(got_residual), residual[rank])
        # and the reference's identity: the residuals owe exactly what the sum lacks
        if feedback:
            owed = (x.astype(np.float64) + r).sum(axis=0)
            kept = np.sum([np.float64(res) for _, res in per_rank], axis=0)
            np.testing.assert_allclose(kept + np.float64(per_rank[0][0]), owed, atol=1e-5)
            want, _ = ref.two_stage_sum(list(x), list(r), compression, block)
            assert np.max(np.abs(np.float64(per_rank[0][0]) - want)) <= np.max(
                2 * ref.error_bound(owed, compression, block)) + 1e-6


def test_the_residual_survives_a_checkpoint(runs):
    resumed = runs[1]["resumes"]["int8"]
    np.testing.assert_allclose(resumed["residual_restored"], resumed["residual_saved"],
                               rtol=0, atol=1e-7)
    assert np.max(np.abs(resumed["residual_saved"])) > 0
    uninterrupted = runs[1]["layouts"]["int8"]["loss"][AT:]
    # the restore gives every replica's residual to the first: the owed sum is the same,
    # its share between replicas is not, so the next quantizations differ a little
    assert _worst(resumed["loss"], uninterrupted) <= 1e-4


@pytest.mark.parametrize("run", ["data", "micro"])
@pytest.mark.parametrize("part", ["gns_grad_sq", "gns_trace"])
def test_gns_parts_are_jaxs(runs, run, part):
    got, want = runs[1]["layouts"][run][part], runs[0][run][part]
    assert None not in got and None not in want
    print(f"{run} {part}: largest relative difference {_worst(got, want):.2e}")
    np.testing.assert_allclose(got, want, rtol=1e-4)  # measured: 6e-6 at most
