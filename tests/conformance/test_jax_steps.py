"""The JAX implementation against the references the suite ships: its steps under every
layout family and with accumulation match the float64 reference, and its records carry the
core's numbers (trainspec/core/conformance_steps.py). torch's are checked by the README tour,
which runs `trainspec conformance --impl torch`."""
import pytest

from trainspec.core.conformance_steps import records_row, step_rows
from trainspec.jax.conformance import JaxConformance

pytestmark = pytest.mark.slow


def test_jax_steps_match_the_shipped_references():
    adapter = JaxConformance("xla")
    rows = {r.family: r for r in [*step_rows(adapter), records_row(adapter)]}
    assert {f: (r.passed, r.failed, r.refused) for f, r in rows.items()} == {
        "reference trajectory": (3, 0, []), "accumulation": (2, 0, []),
        "layout invariance": (5, 0, []), "pipeline": (1, 0, []),
        "metric records": (4, 0, [])}, rows
