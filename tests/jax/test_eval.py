"""`[eval]` on JAX: the step's eval sums are the float64 reference's loss on the same batch
(accumulated over micro-batches), a run records `eval_loss` after every multiple of
eval.interval on held-out text (never on the others), the summary and the report carry it,
and a user's model without eval data trains on, told in one line."""
import json

import jax
import numpy as np
import pytest

from tiny import TINY, tiny_spec
from trainspec.cli.main import main
from trainspec.core import evaluation, reference_model
from trainspec.core.data import CORPUS_BYTES, held_out_corpus, stdlib_corpus
from trainspec.core.records import read_jsonl
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec
from trainspec.jax import layout
from trainspec.jax.evaluate import eval_sums
from trainspec.jax.train import build_job


def test_the_default_spec_evaluates_every_20_steps_on_held_out_text():
    spec = load_spec(DEFAULT_SPEC_PATH)
    assert (spec.eval.interval, spec.eval.batches, spec.eval.source) == (20, 2, "held_out")
    assert [s for s in range(1, spec.train.steps + 1) if evaluation.due(spec, s)] == [20, 40, 60]
    held_out, training = held_out_corpus(), stdlib_corpus()
    # the text past the training corpus: the next bytes of the same files, none trained on
    assert bytes(stdlib_corpus(CORPUS_BYTES + 64)[CORPUS_BYTES:]) == bytes(held_out[:64])
    assert held_out.size > 10_000 and training.size == CORPUS_BYTES


def test_eval_sums_are_the_float64_reference_loss():
    spec = tiny_spec("batch.micro_batch=8")  # two micro-batches
    job = build_job(spec)
    state = job.init_state()
    batch = evaluation.reference_batches(spec).batch(0)
    loss_sum, tokens = eval_sums(job.step, state, batch)
    params = jax.tree.map(np.asarray, jax.device_get(layout.strip_boxes(state.params)))
    want_sum, want_tokens, _ = reference_model.loss_and_grad(params, batch, np.float64)
    assert tokens == want_tokens == 16 * 16
    np.testing.assert_allclose(loss_sum, want_sum, rtol=2e-6)  # float32 sums of 256 tokens


def test_a_run_records_eval_loss_at_each_multiple_of_the_interval(tmp_path, capsys):
    run = tmp_path / "run"
    sets = [a for s in (*TINY, "eval.interval=2", "metrics.interval=3", "checkpoint.interval=0")
            for a in ("--set", s)]
    assert main(["train", "--quiet", "--steps", "4", "--run-dir", str(run),
                 "--summary-json", str(tmp_path / "s.json"), *sets]) == 0
    out = capsys.readouterr().out
    records = {r["step"]: r for r in read_jsonl(run)}
    assert sorted(records) == [1, 2, 3, 4]  # 2 and 4 recorded for their evaluation
    assert [s for s, r in records.items() if "eval_loss" in r] == [2, 4]
    assert 0 < records[4]["eval_loss"] < 6  # below log(256) = 5.5 + slack: it learned some
    assert records[4]["badput_s"]["evaluation"] > 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["eval_loss"] == records[4]["eval_loss"]
    assert f"eval loss      {summary['eval_loss']:.4f}" in out
    assert main(["report", str(run), "--out", str(tmp_path / "r")]) == 0
    assert "<figcaption>Eval loss" in (tmp_path / "r" / "index.html").read_text()


def test_a_user_model_without_eval_data_trains_on_and_says_so(tmp_path, capsys):
    own = str(DEFAULT_SPEC_PATH.parents[1] / "examples" / "own_model.py")
    (tmp_path / "plain.py").write_text(
        "import importlib.util, dataclasses\n"
        f"s = importlib.util.spec_from_file_location('m', {own!r})\n"
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
        "def make(spec):\n    return dataclasses.replace(m.make(spec), eval_batches=None)\n")
    assert main(["train", "--quiet", "--model", f"{tmp_path / 'plain.py'}:make", "--steps",
                 "2", "--run-dir", str(tmp_path / "run"), "--set", "eval.interval=1",
                 "--set", "checkpoint.interval=0"]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "eval" in line] == [
        "trainspec: eval.interval: 1, but the model gives no eval data (a UserModel's "
        "eval_batches, an own loop Run's eval_data=): no eval loss is recorded"]
    assert not any("eval_loss" in r for r in read_jsonl(tmp_path / "run"))
