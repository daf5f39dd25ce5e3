"""`[semi_sync]` (DiLoCo) on torch (trainspec/torch/semi_sync.py), on 4 gloo ranks:

- from JAX's initial parameters (--init-from), the losses and gradient norms of the groups
  follow the JAX implementation's (trainspec/jax/semi_sync.py) within rtol 1e-4 over 8 steps
  (data 4 with an outer step every 3, data 2 x fsdp 2 with one every 2);
- one inner step with a plain outer step (lr 1, no momentum) is synchronous training (SGD,
  no clipping: the mean of the groups' updates is the update of the mean gradient), within 32
  float32 ulps, on 2 ranks; with outer momentum it is not;
- the inner steps count no data-axis traffic (read from the data 4 run above);
- a checkpoint mid-round (step 4 of rounds of 3: the data 4 run above saves every 4 steps)
  resumes bit for bit; a resume on another number of groups is refused in one line.
"""
import shutil

import numpy as np
import pytest

from cli_runs import read_records, read_summary, run_cli, run_cli_ok, train_command
from tiny import TINY
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.torch.models.transformer import Transformer

pytestmark = pytest.mark.slow  # two JAX runs and seven torch jobs: over a minute on 2 cores

STEPS, RANKS = 8, 4
# data 4 in rounds of 3 saving every 4 steps, so its checkpoint at step 4 is mid-round
MID_ROUND = ["semi_sync.inner_steps=3", "checkpoint.interval=4", "checkpoint.keep=3"]
LAYOUTS = {"data4": MID_ROUND,
           "data2_fsdp2": ["semi_sync.inner_steps=2", "checkpoint.interval=0",
                           "mesh.axes.data.size=2", "mesh.axes.fsdp.size=2"]}
SGD = ['optimizer.name="sgd"', "optimizer.grad_clip_norm=1e9", "optimizer.learning_rate=0.3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """layout -> (JAX's records, the torch run's dir, its records): JAX on 4 devices writes
    its initial parameters, torch on 4 ranks starts from them (--init-from)."""
    tmp, found = tmp_path_factory.mktemp("semi_sync"), {}
    for name, sets in LAYOUTS.items():
        jax_dir, torch_dir = tmp / f"jax_{name}", tmp / f"torch_{name}"
        want = _train(jax_dir, [*sets, "checkpoint.interval=0"], "--host-devices", "4",
                      framework=None)
        found[name] = (want, torch_dir, _train(torch_dir, sets, "--init-from", str(jax_dir)))
    return found


def test_the_groups_follow_the_jax_implementation(runs):
    """The records' losses and gradient norms, combined over the groups on either side, agree
    within rtol 1e-4. The inner steps carry nothing over the data axes: amortised over the
    round, 1/H of the outer step's all-reduce is all of `data`'s."""
    for name, (want, _, got) in runs.items():
        for quantity in ("loss", "grad_norm"):
            np.testing.assert_allclose([r[quantity] for r in got], [r[quantity] for r in want],
                                       rtol=1e-4, err_msg=f"{name} {quantity}")
    semi = read_summary(runs["data4"][1])["semi_sync"]
    assert semi["inner_comm_bytes_per_step"] == 0 and semi["outer_comm_bytes"] == _param_bytes()
    assert semi["groups"] == 4 and semi["inner_steps"] == 3


def _cmd(run_dir, sets, *extra, steps=STEPS, nprocs=RANKS, framework="torch"):
    """A torch job of `nprocs` ranks, or with framework=None the JAX one."""
    return train_command(run_dir, [*TINY, "metrics.interval=1", *sets], *extra, steps=steps,
                         framework=framework, nprocs=nprocs if framework else None)


def _train(run_dir, sets, *extra, **kwargs):
    run_cli_ok(_cmd(run_dir, sets, *extra, **kwargs))
    return read_records(run_dir)


def test_one_inner_step_with_a_plain_outer_step_is_synchronous(tmp_path):
    """On 2 groups: the mean of the groups' updates is the same identity for any number."""
    plain = ["semi_sync.outer_lr=1.0", "semi_sync.outer_momentum=0.0"]
    sync = _train(tmp_path / "sync", [*SGD, "checkpoint.interval=0"], nprocs=2)
    h1 = _train(tmp_path / "h1", [*SGD, "checkpoint.interval=0", "semi_sync.inner_steps=1", *plain],
                nprocs=2)
    momentum = _train(tmp_path / "momentum", [*SGD, "checkpoint.interval=0",
                                              "semi_sync.inner_steps=1", plain[0],
                                              "semi_sync.outer_momentum=0.5"], nprocs=2)
    want = np.array([r["loss"] for r in sync])
    tol = 32 * 2.0**-23 * float(np.max(want))
    assert np.max(np.abs(np.array([r["loss"] for r in h1]) - want)) <= tol
    assert np.max(np.abs(np.array([r["loss"] for r in momentum]) - want)) > 100 * tol
    # the outer step's all-reduce of the float32 parameters, every step when H = 1
    assert {r["comm_bytes_by_axis"]["data"] for r in h1} == {_param_bytes()}


def _param_bytes() -> int:
    """The tiny model's float32 parameters, in bytes: what one outer step all-reduces."""
    model = Transformer(load_spec(DEFAULT_SPEC_PATH, TINY).model)
    return 4 * sum(x.numel() for x in model.parameters())


def test_a_checkpoint_mid_round_resumes_bitwise(runs, tmp_path):
    _, whole, records = runs["data4"]
    want = {r["step"]: r["loss"] for r in records}
    run_dir = tmp_path / "resumed"
    shutil.copytree(whole, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / str(STEPS))  # from step 4: the round began at 3
    # the same command (its --init-from is not used: a resume wins)
    got = {r["step"]: r["loss"] for r in _train(run_dir, MID_ROUND, "--init-from",
                                                  str(whole.parent / "jax_data4"))}
    assert read_summary(run_dir)["resumed_from"] == 4
    assert got == want
    other = run_cli(_cmd(run_dir, MID_ROUND, steps=STEPS + 2, nprocs=2))
    assert other.returncode == 2, other.stdout[-3000:] + other.stderr[-3000:]
    said = {line.split("] ", 1)[1] for line in other.stdout.splitlines() if "error" in line}
    assert said == {f"trainspec: error: semi_sync: the checkpoint in {run_dir}/checkpoints/8 "
                    "holds 4 data groups' states, the mesh gives 2; resume on 4 data groups, or "
                    "use another --run-dir"}, other.stdout + other.stderr
    assert "Traceback" not in other.stdout + other.stderr
