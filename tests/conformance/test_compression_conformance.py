"""The conformance suite's compression families (trainspec/core/conformance_runner.py) against the JAX
backends: the round-trip bounds per format and block and the exact error-feedback identity
pass on xla and ext, are skipped (saying why) where compression is not offered, and fail for
a quantizer that breaks them."""
import numpy as np
import pytest

from trainspec.core import conformance_runner as runner
from trainspec.jax.conformance import JaxConformance
from trainspec.core import conformance as cases
from trainspec.core import packed

CASES = len(cases.COMPRESSION_FORMATS) * len(cases.COMPRESSION_SIZES)


@pytest.mark.parametrize("backend", ["xla", "ext"])
def test_backends_pass_the_compression_families(backend):
    rows = runner._compression_rows(JaxConformance(backend))
    assert [(r.family, r.passed, r.failed) for r in rows] == [
        ("compression bounds", CASES, 0), ("error feedback", CASES, 0)], rows


def test_int8_bound_is_nearly_reached():
    """The half step dominates the bound: the worst element errs by more than 0.45 scale."""
    x = cases.compression_inputs(1027, "tightness")[0]
    sent = JaxConformance("xla").error_feedback(x, np.zeros_like(x), "int8", 32)[0]
    scales = np.repeat(packed.quantize_int8(x, 32)[0], 32)[: x.size].astype(np.float64)
    assert np.max(np.abs(sent - x.astype(np.float64)) / scales) > 0.45


def test_without_compression_the_families_are_skipped_saying_why():
    rows = runner._compression_rows(JaxConformance("hierarchical"))
    assert all(r.skipped == "hierarchical reports collectives.compression unsupported"
               and r.passed == r.failed == 0 for r in rows)
    line = runner.table("hierarchical", rows).splitlines()[2]
    assert line.split() == ["compression", "bounds", "-", "-", "-", "skipped:", "hierarchical",
                            "reports", "collectives.compression", "unsupported"]


class _SixBitInt8(JaxConformance):
    """int8 sent on a grid twice as coarse, and the residual one ulp off."""

    def error_feedback(self, x, residual, compression, block):
        sent, new_residual = super().error_feedback(x, residual, compression, block)
        if compression == "int8":
            scales = np.repeat(packed.quantize_int8(x + residual, block)[0], block)[: x.size]
            sent = (np.round(sent / scales / 2) * 2 * scales).astype(np.float32)
            new_residual = np.nextafter(new_residual, np.float32(np.inf))
        return sent, new_residual


def test_a_coarser_quantizer_fails_both_families():
    bounds, feedback = runner._compression_rows(_SixBitInt8("xla"))
    assert bounds.failed > 0 and "above the bound" in bounds.first_failure
    assert feedback.failed > 0 and "int8" in feedback.first_failure
    assert bounds.passed >= len(cases.COMPRESSION_SIZES)  # bf16 still passes
