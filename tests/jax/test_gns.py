"""Gradient noise scale measured inside the wrapped step (docs/advice.md).

The estimator is unbiased per step, so each check averages T steps' estimates and allows
4 standard errors of that mean, the standard error taken from the T estimates' own spread
(each step draws fresh samples, so they are independent). The tests also bound that error,
so a tolerance cannot grow until any answer passes.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

from trainspec.jax import grad_step, loss_step, wrap
from trainspec.core import gns
from trainspec.core.gns import unbiased_parts
from trainspec.core.data import ByteBatches
from trainspec.core.errors import UserInputError
from trainspec.core.advice import advise
from trainspec.jax.metrics.logger import MetricsLogger
from trainspec.jax.models.transformer import Transformer, next_token_loss
from trainspec.core.spec import ModelSpec, load_spec

FROZEN = optax.sgd(0.0)  # the parameters stay where the truth is known

# -- linear regression: y = w*.x + eps, x ~ N(0, I_d), eps ~ N(0, sigma^2), loss (w.x - y)^2 / 2.
# At w = w* + delta the per-example gradient is (delta.x - eps) x, so G = delta and
# E|g|^2 = (d + 2)|delta|^2 + d sigma^2, i.e. tr Sigma = d(|delta|^2 + sigma^2) + |delta|^2.
D, SIGMA, ROWS, STEPS = 16, 0.5, 256, 200


def _regression_loss(params, batch):
    residual = batch["x"] @ params["w"] - batch["y"]
    return 0.5 * jnp.sum(residual**2), jnp.float32(residual.shape[0]), {}


def _regression_batches(w_star, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        x = rng.standard_normal((ROWS, D)).astype(np.float32)
        y = (x @ w_star + SIGMA * rng.standard_normal(ROWS)).astype(np.float32)
        yield {"x": x, "y": y}


def _mean_and_error(values):
    values = np.asarray(values, np.float64)
    return values.mean(), 4 * values.std(ddof=1) / np.sqrt(len(values))


def _regression_grad(params, batch):  # the same model as a grad/update split (rows as unit)
    loss = lambda p: _regression_loss(p, batch)[0] / batch["y"].shape[0]  # noqa: E731
    return jax.grad(loss)(params), {}


def _apply_grads(state, grads):
    return state.apply_gradients(grads=grads)


FORMS = {"loss_step": loss_step(_regression_loss), "grad_step": grad_step(_regression_grad, _apply_grads)}


def _run_regression(axes, micro=None, form="loss_step"):
    rng = np.random.default_rng(0)
    w_star = rng.standard_normal(D).astype(np.float32)
    delta = rng.standard_normal(D).astype(np.float32)
    delta /= np.linalg.norm(delta)  # |delta|^2 = 1
    spec = load_spec({"mesh": {"axes": axes},
                      "batch": {"global_batch": ROWS, "micro_batch": micro or ROWS}})
    step = wrap(FORMS[form], spec)
    state = step.init(lambda: TrainState.create(
        apply_fn=None, params={"w": jnp.asarray(w_star + delta)}, tx=FROZEN))
    parts = []
    for batch in _regression_batches(w_star):
        state, metrics = step(state, batch)
        # synced per step: the CPU runtime can deadlock with hundreds of collective programs
        # in flight (docs/xla_ext.md), and these steps are too small to care
        parts.append(jax.device_get((metrics["gns_grad_sq"], metrics["gns_trace"])))
    grad_sq, trace = np.asarray(parts).T
    return step, grad_sq, trace


# The regression's one parameter is unannotated, so replicated over fsdp on purpose: wrap's
# warning about it (tested in test_wrap_friction.py) is expected here.
@pytest.mark.filterwarnings("ignore:init_fn.*carry no logical axis names:UserWarning")
@pytest.mark.parametrize("axes, micro, source, form", [
    ({"data": {"size": 8}}, None, "replicas", "loss_step"),                # B_small = 32 rows
    ({"data": {"size": 1}, "fsdp": {"size": 8}}, 32, "micro_batches", "loss_step"),  # 8 micro
    ({"data": {"size": 8}}, None, "replicas", "grad_step"),  # plain step split at its gradient
])
def test_closed_form_linear_regression(axes, micro, source, form):
    step, grad_sq, trace = _run_regression(axes, micro, form)
    assert step.gns_source == source
    truth_grad_sq, truth_trace = 1.0, D * (1.0 + SIGMA**2) + 1.0
    g, g_err = _mean_and_error(grad_sq)
    t, t_err = _mean_and_error(trace)
    assert g_err < 0.25 * truth_grad_sq and t_err < 0.1 * truth_trace  # the test has power
    assert abs(g - truth_grad_sq) < g_err, (g, g_err)
    assert abs(t - truth_trace) < t_err, (t, t_err)
    # B_simple of the means: the relative errors add (first order), so the bound is their sum.
    b, truth_b = t / g, truth_trace / truth_grad_sq
    assert abs(b / truth_b - 1) < g_err / g + t_err / t, (b, truth_b)


# -- the small transformer: the data-parallel estimate from explicit per-example gradients.
MODEL = ModelSpec(vocab_size=256, d_model=32, n_layers=1, n_heads=2, d_ff=64)
SEQ, BATCH = 16, 32


def _lm_loss(params, batch):
    logits = Transformer(MODEL).apply({"params": params}, batch["inputs"])
    loss_sum, tokens = next_token_loss(logits, batch["targets"], batch["mask"])
    return loss_sum, tokens, {}


def _lm_state():
    params = Transformer(MODEL).init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
    return TrainState.create(apply_fn=None, params=params, tx=FROZEN)


def _lm_step(axes):
    spec = load_spec({"mesh": {"axes": axes},
                      "batch": {"global_batch": BATCH, "seq_len": SEQ}})
    step = wrap(loss_step(_lm_loss), spec)
    return step, step.init(_lm_state)


def test_replica_estimate_matches_explicit_per_example_gradients():
    step, state = _lm_step({"data": {"size": 8}})
    batch = ByteBatches(SEQ, BATCH, seed=5).batch(0)
    params = jax.device_get(state.params)  # before the step: it donates the state
    _, metrics = step(state, batch)

    def example_grad(example):  # gradient of one sequence's mean per-token loss
        one = jax.tree.map(lambda x: x[None], example)
        return jax.grad(lambda p: _lm_loss(p, one)[0] / SEQ)(params)

    per_example = jax.jit(jax.vmap(example_grad))(batch)
    flat = np.concatenate([np.asarray(x, np.float64).reshape(BATCH, -1)
                           for x in jax.tree.leaves(per_example)], axis=1)
    replicas = flat.reshape(8, BATCH // 8, -1).mean(axis=1)  # replica r: its block of rows
    small_sq = np.mean(np.sum(replicas**2, axis=1))
    big_sq = np.sum(flat.mean(axis=0) ** 2)
    grad_sq, trace = unbiased_parts(small_sq, big_sq, BATCH // 8 * SEQ, BATCH * SEQ)
    # float32 sums of ~10^4 squares against float64: relative 1e-4 leaves a wide margin, and
    # the difference of near-equal norms in tr Sigma is what bounds it.
    np.testing.assert_allclose(float(metrics["gns_grad_sq"]), grad_sq, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["gns_trace"]), trace, rtol=1e-4)


def test_noise_scale_is_invariant_to_layout():
    """data=8 (B_small = 4 rows) and data=2 x fsdp=4 (B_small = 16 rows: fsdp splits a replica,
    it does not make one) estimate the same quantities on the same batches."""
    steps, estimates = 40, {}
    for name, axes in {"data8": {"data": {"size": 8}},
                       "data2_fsdp4": {"data": {"size": 2}, "fsdp": {"size": 4}}}.items():
        step, state = _lm_step(axes)
        parts = []
        for i in range(steps):
            state, metrics = step(state, ByteBatches(SEQ, BATCH, seed=7).batch(i))
            parts.append(jax.device_get((metrics["gns_grad_sq"], metrics["gns_trace"])))
        estimates[name] = np.asarray(parts, np.float64).T
    (g8, t8), (g2, t2) = estimates["data8"], estimates["data2_fsdp4"]
    for a, b in ((g8, g2), (t8, t2)):
        (ma, ea), (mb, eb) = _mean_and_error(a), _mean_and_error(b)
        assert abs(ma - mb) < np.hypot(ea, eb), (ma, ea, mb, eb)
    ratio = (t8.mean() / g8.mean()) / (t2.mean() / g2.mean())
    assert 0.5 < ratio < 2.0, ratio  # noise-limited (40 steps); the parts are checked above


# -- the estimate of the current state from the per-step parts (trainspec.core.gns).
def _noisy_parts(rng, grad_sq, trace=10.0):
    """Per-step part estimates around the given |G|^2 series and a steady tr Sigma, noisy as
    the default job's late steps are (sd 0.8 x the final |G|^2 and 0.3 x tr Sigma) and
    anti-correlated as the two-batch estimator makes them."""
    e = rng.multivariate_normal([0, 0], [[1, -0.5], [-0.5, 1]], size=len(grad_sq))
    return grad_sq + 0.8 * grad_sq[-1] * e[:, 0], trace + 0.3 * trace * e[:, 1]


def _holds(estimate, b_simple):
    """Whether the estimate's interval (None: no bound that side) holds `b_simple`."""
    return (estimate.low or 0.0) <= b_simple <= (estimate.high or np.inf)


def test_interval_holds_the_truth_at_its_confidence_and_steady_runs_keep_every_step():
    rng = np.random.default_rng(0)
    runs = [gns.estimate(*_noisy_parts(rng, np.ones(60))) for _ in range(400)]
    covered = np.mean([_holds(e, 10.0) for e in runs])
    # 400 draws of a 90% interval: binomial sd 1.5 %, so [0.85, 0.95] is over 3 sd each side
    assert 0.85 <= covered <= 0.95, covered
    full = np.mean([e.window == 60 and not e.trend_limited for e in runs])
    assert full >= 0.9, full  # a steady state is rarely cut short (AGREE_Z = 3 per test)


def test_window_stops_where_the_state_moved():
    """|G|^2 fell 10x 40 steps ago: the window stays within the 40 (the candidates are 32 and
    48), older steps are reported to disagree, and the interval holds the final state's 10/1
    about as often as its confidence says."""
    rng = np.random.default_rng(1)
    grad_sq = np.r_[np.full(100, 10.0), np.ones(40)]
    runs = [gns.estimate(*_noisy_parts(rng, grad_sq)) for _ in range(200)]
    assert all(e.trend_limited and e.window <= 40 for e in runs)
    assert np.median([e.window for e in runs]) == 32
    assert np.mean([_holds(e, 10.0) for e in runs]) >= 0.8


def test_t_quantile_matches_scipy():
    from scipy import stats

    for dof in (2, 3, 5, 10, 40, 1000):
        assert gns.t_quantile(0.95, dof) == pytest.approx(stats.t.ppf(0.95, dof), rel=0.015)
    for dof in (5, 10, 40):  # the window test's tail (AGREE_Z = 3 sd), from 6 steps on
        assert gns.t_quantile(0.99865, dof) == pytest.approx(stats.t.ppf(0.99865, dof), rel=0.015)


# -- |G|^2 falling 1000x: advise must read the run's final state, not its history.
# Per row the loss |w - x|^2 / 2 with x ~ N(mu, I): the per-row gradient is w - x, so G = w - mu
# and tr Sigma = d at every w. SGD at rate LR multiplies |G|^2 by (1 - LR)^2 a step down to its
# floor E|G|^2 = LR d / (B (2 - LR)): from 1000x the floor it falls 1000x in 12 steps, and stays
# near B_simple = B (2 - LR) / LR = 7 batches. d is large so |G|^2 of one state is within a few %
# of the floor (a chi-square of d degrees): the final state is then typical of the last steps.
D_MEAN, LR, FALL_RUN, HELD_OUT = 2048, 0.25, 80, 8192
SGD = optax.sgd(LR)  # one optimizer object: init_fn is called twice (docs/wrapping.md)


def _mean_loss(params, batch):
    return 0.5 * jnp.sum((params["w"] - batch["x"]) ** 2), jnp.float32(batch["x"].shape[0]), {}


def _held_out_b_simple(w, mu, rng):
    """tr Sigma / |G|^2 from per-row gradients at w on HELD_OUT fresh rows: the per-row
    covariance's trace, and |mean|^2 less its expected excess tr Sigma / N."""
    total, sq = np.zeros(D_MEAN), 0.0
    for _ in range(HELD_OUT // 1024):
        grads = w - (mu + rng.standard_normal((1024, D_MEAN)))
        total += grads.sum(axis=0)
        sq += np.sum(grads**2)
    mean = total / HELD_OUT
    trace = (sq - HELD_OUT * mean @ mean) / (HELD_OUT - 1)
    return trace / (mean @ mean - trace / HELD_OUT)


def test_advise_reads_the_final_state_after_the_gradient_falls_1000x(tmp_path):
    rng = np.random.default_rng(0)
    mu = rng.standard_normal(D_MEAN)
    delta = rng.standard_normal(D_MEAN)
    delta *= np.sqrt(1000 * LR * D_MEAN / (ROWS * (2 - LR))) / np.linalg.norm(delta)
    spec = load_spec({"mesh": {"axes": {"data": {"size": 8}}},
                      "batch": {"global_batch": ROWS, "seq_len": 1}})  # the unit is a row
    step = wrap(loss_step(_mean_loss), spec)
    state = step.init(lambda: TrainState.create(
        apply_fn=None, params={"w": jnp.asarray(mu + delta, jnp.float32)}, tx=SGD))
    batches = [{"x": (mu + rng.standard_normal((ROWS, D_MEAN))).astype(np.float32)}
               for _ in range(FALL_RUN)]
    logger = MetricsLogger.for_run(spec, step, state, batches[0], tmp_path, FALL_RUN)
    for i, batch in enumerate(batches, 1):
        state, metrics = step(state, batch)
        logger.after_step(i, metrics)
    logger.close()
    w = np.asarray(jax.device_get(state.params["w"]), np.float64)
    assert delta @ delta / np.sum((w - mu) ** 2) > 500  # |G|^2 did fall ~1000x
    reference = _held_out_b_simple(w, mu, rng)
    assert reference == pytest.approx(D_MEAN / np.sum((w - mu) ** 2), rel=0.05)  # closed form
    result = advise(tmp_path, spec)
    assert result["critical_batch_tokens"] == pytest.approx(reference, rel=0.3), reference
    assert result["window_steps"] <= FALL_RUN - 12  # the fall is outside the window


def test_gns_true_without_a_second_batch_size_is_one_line_error():
    spec = load_spec({"mesh": {"axes": {"data": {"size": 1}, "fsdp": {"size": -1}}},
                      "batch": {"global_batch": 16, "seq_len": SEQ}, "metrics": {"gns": True}})
    with pytest.raises(UserInputError, match=r"^metrics.gns = true cannot be measured: one "):
        wrap(loss_step(_lm_loss), spec)
    auto = wrap(loss_step(_lm_loss), load_spec(spec.to_dict() | {"metrics": {}}))
    assert auto.gns_source is None and "one data-parallel replica" in auto.gns_note
