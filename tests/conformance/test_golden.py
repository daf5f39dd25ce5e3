"""The references the suite ships (trainspec/core/golden.json) are the float64 NumPy
reference's numbers: recomputed on the shipped batches, they are the same."""
import numpy as np

from trainspec.core import golden, reference_train as ref


def test_the_shipped_references_are_the_reference_s_numbers():
    shipped = golden.load()
    again = golden.compute(shipped.batches)
    assert again["batches"] == shipped.raw["batches"]
    assert again["spec"] == shipped.raw["spec"] and again["optimizers"] == shipped.raw["optimizers"]
    for got, want in ((again["initial_digest"], shipped.initial_digest),
                      (again["trajectories"], shipped.trajectories)):
        flat_got, flat_want = _numbers(got), _numbers(want)
        np.testing.assert_allclose(flat_got, flat_want, rtol=1e-12, atol=1e-15)


def test_the_first_step_updates_with_the_full_learning_rate():
    spec = golden.spec()
    assert ref.learning_rate(spec.optimizer, spec.train.steps, 0) == spec.optimizer.learning_rate
    first = golden.load().trajectories["adamw"][0]["digest"]
    assert all(d[0] > 0 for d in first.values())  # every parameter moved


def _numbers(tree):
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in _numbers(tree[k])]
    if isinstance(tree, list):
        return [x for v in tree for x in _numbers(v)]
    return [tree]
