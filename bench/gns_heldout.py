"""The run's GNS estimate against per-sequence gradients on held-out data, at chosen steps.

Trains the default job (8 simulated CPU devices) for --steps steps, keeping each step's
two-batch parts. At each step of --at it prints the estimate the run's record would carry then
(trainspec.core.gns.estimate: window, 90% interval) and the reference at that step's state:
per-sequence gradients of --held-out sequences the run never draws (another data seed),

    tr Sigma = L * sum_i |g_i - mean|^2 / (N - 1),   |G|^2 = |mean|^2 - tr Sigma / (L N)

(L = seq_len: tokens, the records' unit), B_simple = tr Sigma / |G|^2, with a 90% bootstrap
interval over chunks of 32 sequences; and next to the held-out |G|^2 the run's own one-step
estimate on the same state (the next step's, which measures the state before its update).
    python bench/gns_heldout.py [--steps 60] [--at 40,50,60 | --at 30:60] [--held-out 1024]
                                [--dump PARTS.json]
--dump writes every step's two-batch parts and the held-out parts at each state of --at, for
bench/gns_coverage.py to score estimators against the held-out value over their window.
"""
import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from trainspec.core.data import ByteBatches  # noqa: E402
from trainspec.core.gns import estimate  # noqa: E402
from trainspec.jax import default_spec  # noqa: E402
from trainspec.jax.train import _components, build_job  # noqa: E402

CHUNK = 32  # sequences per held-out chunk: the bootstrap resamples chunks
HELD_OUT_SEED = 10_000  # not a seed the default job draws batches from


def steps_arg(text: str) -> list[int]:
    """'40,50,60' or '30:60' (both ends included)."""
    if ":" in text:
        first, last = map(int, text.split(":"))
        return list(range(first, last + 1))
    return [int(s) for s in text.split(",")]


def held_out_reference(loss_fn, params, seq_len: int, sequences: int, rng) -> dict:
    @jax.jit
    def chunk_sums(params, batch):
        def sequence_grad(example):  # gradient of one sequence's mean per-token loss
            one = jax.tree.map(lambda x: x[None], example)
            return jax.grad(lambda p: loss_fn(p, one)[0] / seq_len)(params)

        grads = jax.vmap(sequence_grad)(batch)
        flat = jnp.concatenate([g.reshape(CHUNK, -1) for g in jax.tree.leaves(grads)], axis=1)
        return flat.sum(axis=0), jnp.sum(flat * flat)

    data = ByteBatches(seq_len, CHUNK, HELD_OUT_SEED)
    sums, squares = zip(*(jax.device_get(chunk_sums(params, data.batch(c)))
                          for c in range(sequences // CHUNK)))
    sums = np.asarray(sums, np.float64)
    gram, squares = sums @ sums.T, np.asarray(squares, np.float64)

    def b_simple(weights):  # chunks drawn `weights` times each
        n = CHUNK * weights.sum()
        mean_sq = weights @ gram @ weights / n**2
        trace = (weights @ squares - n * mean_sq) / (n - 1)  # per sequence
        return seq_len * trace / (mean_sq - trace / n)  # per token: x seq_len

    chunks = len(squares)
    boot = [b_simple(rng.multinomial(chunks, np.full(chunks, 1 / chunks)).astype(float))
            for _ in range(1000)]
    n = CHUNK * chunks
    mean_sq = gram.sum() / n**2
    trace = (squares.sum() - n * mean_sq) / (n - 1)
    return {"b": b_simple(np.ones(chunks)), "p05": np.percentile(boot, 5),
            "p95": np.percentile(boot, 95), "grad_sq": mean_sq - trace / n,
            "trace": seq_len * trace}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--at", type=steps_arg, default=None, help="steps to compare (default: last)")
    p.add_argument("--held-out", type=int, default=1024, help="held-out sequences")
    p.add_argument("--dump", help="write the run's per-step parts and the held-out parts (JSON)")
    args = p.parse_args()
    at = set(args.at or [args.steps])
    spec = default_spec()
    job = build_job(spec, total_steps=args.steps)
    _, loss_fn, _ = _components(spec, args.steps)
    state, parts, rng = job.state, [], np.random.default_rng(0)
    fmt = lambda v: "inf" if v is None else f"{v:.0f}"  # noqa: E731
    print(f"{'step':>5} {'window':>6} {'estimate':>9} {'90% interval':>17}   "
          f"{'held-out':>9} {'90% bootstrap':>17}   {'|G|^2 held-out':>14} {'one step':>9}")
    pending = None  # (the line so far, held-out |G|^2) until the next step measures that state
    held_out = {}  # state (updates applied) -> held-out parts
    for step in range(1, args.steps + 2):
        state, metrics = job.step(state, job.data.batch(step - 1))
        parts.append(jax.device_get((metrics["gns_grad_sq"], metrics["gns_trace"])))
        if pending:
            print(f"{pending[0]}   {pending[1]:>14.4g} {parts[-1][0]:>9.4g}", flush=True)
            pending = None
        if step in at:
            e = estimate(*np.asarray(parts).T)
            ref = held_out_reference(loss_fn, jax.device_get(state.params), spec.batch.seq_len,
                                     args.held_out, rng)
            held_out[step] = {"grad_sq": float(ref["grad_sq"]), "trace": float(ref["trace"])}
            pending = (f"{step:>5} {e.window:>6} {fmt(e.b_simple):>9} "
                       f"{fmt(e.low):>8}-{fmt(e.high):<8}   {ref['b']:>9.0f} "
                       f"{ref['p05']:>8.0f}-{ref['p95']:<8.0f}", ref["grad_sq"])
    if args.dump:  # parts[i] is step i+1's, measured on the state after i updates
        with open(args.dump, "w") as f:
            json.dump({"steps": args.steps, "held_out_sequences": args.held_out,
                       "run_parts": np.asarray(parts, np.float64).tolist(),
                       "held_out": held_out}, f)


if __name__ == "__main__":
    main()
