"""The conformance suite can fail (tests/conformance/broken_impls.py): an implementation that
trains nothing, one that clips to the wrong norm, ones that leave out weight decay, decay only
the 1-D parameters or warm up one update early, one that claims layouts it cannot run and one
whose table leaves a field out each fail it, naming the case or the field; the numpy
implementation passes the subset it declares, its refused layouts named."""
import pytest

import broken_impls
from numpy_impl import NumpyAdapter
from trainspec.core.conformance_runner import run, table
from trainspec.core import golden
from trainspec.core.conformance_steps import step_rows


def _rows(adapter) -> dict:
    return {r.family: r for r in run(adapter, quick=True)}


@pytest.fixture(scope="module")
def numpy_rows():
    return _rows(NumpyAdapter())


def test_the_numpy_implementation_passes_what_it_declares(numpy_rows):
    assert not any(r.failed for r in numpy_rows.values()), table("numpy", list(numpy_rows.values()))
    for family in ("reference trajectory", "accumulation", "metric records", "capability table"):
        assert numpy_rows[family].passed > 0, family
    layouts = numpy_rows["layout invariance"]
    assert layouts.passed == 0 and len(layouts.refused) == 5
    assert layouts.refused[0] == ("fsdp: mesh.axes.*.size: the numpy implementation splits data "
                                  "axes only")


def test_the_do_nothing_implementation_fails():
    rows = _rows(broken_impls.DoNothing())
    for family in ("reference trajectory", "accumulation", "metric records"):
        assert rows[family].failed > 0, family
    assert (rows["reference trajectory"].first_failure
            == "adamw: step 1: loss 5.5, reference 6.261992")
    assert "learning_rate 0.001, the core gives 0.003" in rows["metric records"].first_failure
    # what it gets right: the collectives are the core's own reference
    assert not any(rows[op].failed for op in ("all_reduce", "permute", "illegal calls"))


def test_a_wrong_clip_norm_fails_the_trajectories(numpy_rows):
    rows = _rows(broken_impls.WrongClip())
    trajectory = rows["reference trajectory"]
    assert trajectory.failed == len(golden.OPTIMIZERS)
    assert "of its update away from the reference" in trajectory.first_failure
    assert rows["accumulation"].failed == numpy_rows["accumulation"].passed


def test_a_layout_claimed_and_not_run_fails_naming_the_case():
    layouts = _rows(broken_impls.Overclaiming())["layout invariance"]
    assert layouts.failed == 5 and not layouts.refused
    assert layouts.first_failure.startswith("fsdp: raised NotImplementedError: the numpy "
                                            "implementation splits data axes only")


def test_a_field_left_out_of_the_table_fails_naming_it():
    row = _rows(broken_impls.Undeclared())["capability table"]
    assert row.failed == 1
    assert row.first_failure == "metrics.tensorboard: not declared by undeclared's capability table"


@pytest.mark.parametrize("impl,failure", [
    (broken_impls.NoDecay, "adamw-decay-warmup: step 2: block_0/"),
    (broken_impls.DecayOneDimOnly, "adamw-decay-warmup: step 2: block_0/key/kernel"),
    (broken_impls.EarlyWarmup, "adamw-decay-warmup: step 1: block_0/attn_norm/scale moved 0.0"),
])
def test_a_wrong_decay_or_warmup_fails_the_trajectory_that_uses_them(impl, failure):
    """The jobs without decay or warm-up pass; the one with both fails at its first update
    with a nonzero learning rate (step 2), or at step 1 for a warm-up that starts early."""
    trajectory = step_rows(impl())[0]
    assert (trajectory.passed, trajectory.failed) == (2, 1), trajectory
    assert trajectory.first_failure.startswith(failure), trajectory.first_failure
