"""Held-out evaluation during training (`[eval]`, docs/spec.md): which steps evaluate, the
reference job's eval data, and the loss from an implementation's sums.

After every step that is a multiple of `eval.interval` the run loop (trainspec.core.run) asks
the implementation's step for the summed loss and valid tokens of `loss_fn` on each of the
`eval.batches` eval batches (the same ones every time: batch indices 0, 1, ...) and records
their ratio, token-weighted over all of them as training's loss is, as `eval_loss`.
"""
from __future__ import annotations

import logging

from trainspec.core.data import ByteBatches, held_out_corpus, stdlib_corpus
from trainspec.core.errors import UserInputError

log = logging.getLogger("trainspec")
OTHER_WINDOWS_SEED = 1_000_003  # source = "training": windows training's seeds never draw


def evaluates(spec, step, writer: bool) -> bool:
    """Whether the run evaluates: `eval.interval` > 0 and the step has eval data (a user's
    model without `eval_batches` is told in one line, by the writing process, and trains on)."""
    if not spec.eval.interval:
        return False
    if getattr(step, "eval_data", None) is None:
        if writer:
            log.warning("eval.interval: %d, but the model gives no eval data (a UserModel's "
                        "eval_batches, an own loop Run's eval_data=): no eval loss is "
                        "recorded", spec.eval.interval)
        return False
    return True


def due(spec, step: int) -> bool:
    return spec.eval.interval > 0 and step % spec.eval.interval == 0


def reference_batches(spec) -> ByteBatches:
    """The reference job's eval batches: windows of the held-out text, or other windows of the
    training corpus (`eval.source`), of the training batch's shape."""
    held_out = spec.eval.source == "held_out"
    corpus = held_out_corpus() if held_out else stdlib_corpus()
    if corpus.size <= spec.batch.seq_len + 1:
        raise UserInputError(
            f"eval.source: this Python's standard library holds {corpus.size} bytes past the "
            f"training corpus, too few for windows of {spec.batch.seq_len + 1}; set "
            'eval.source = "training"')
    return ByteBatches(spec.batch.seq_len, spec.batch.global_batch,
                       spec.seed if held_out else spec.seed + OTHER_WINDOWS_SEED, corpus)


def eval_loss(sums: list[tuple[float, float]]) -> float | None:
    """Token-weighted mean loss over the eval batches' (loss sum, valid tokens); None (null in
    the records) when the loss is not finite or no token counts."""
    loss, tokens = sum(s for s, _ in sums), sum(t for _, t in sums)
    value = loss / tokens if tokens > 0 else float("nan")
    return value if value == value and abs(value) != float("inf") else None
