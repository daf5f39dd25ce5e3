"""What `trainspec.jax.wrap` costs over plain `jax.jit` with donation, on an unchanged user step.

The user's code is an image classifier written the way flax's MNIST/ImageNet examples write one:
a small CNN module, a `TrainState` with an optax optimizer, and a `train_step(state, batch)`
that takes `value_and_grad` of the cross-entropy, applies the gradients and returns
`(state, metrics)`. Both sides get the same host (NumPy) batches, so both pay the transfer:
- plain: `jax.jit(train_step, donate_argnums=0)`, the batch `device_put` onto the data axis;
- rollback: `trainspec.jax.wrap(train_step, spec)` under the default `health.nan.policy =
  rollback` (placement, donation; the step is the user's own), with what the run loop adds:
  the losses (and gradient norms, where the step has one) of the steps not yet judged read
  on the host and judged where the loop reads its loss anyway, and otherwise VERDICT_BATCH
  (10) at a time behind the newest VERDICT_LAG (3) (trainspec.core.bad_steps.PendingVerdicts).
  The state itself is checked before each checkpoint only, and there is none here;
- each: the same, the verdict of the step VERDICT_LAG back read after every step (the timing
  before batching, for the A/B);
- flags: the state checked after every step instead, for comparison: the wrapped step
  (unguarded) also counting, on each device, the non-finite elements of its slices of the new
  state (trainspec.jax.health.nan), those flags read with the loss as late;
- skip: the same under `health.nan.policy = skip`, the guard that keeps the old state until a
  verdict (an all-reduce of the state's check and a `lax.cond`), read by nothing per step;
- unguarded: the same with `nan_guard=False`: nothing judged;
- the skip guard's two costs apart, as plain jit of the step followed by one of them alone:
  `meeting`, one all-reduce of one scalar that depends on every floating leaf of the new state
  (the end-of-step meeting of the devices that any verdict on the new state needs, with no
  check and no copy), and `copy`, a `lax.cond` keeping the new state or the old one on the loss
  alone (a value the step has already all-reduced, so no new meeting): the copy of the state
  into the donated buffer that keeping the old state until a verdict costs.
Every line's loop, plain jit's too, reads its step's loss on the host every `--log-every`
steps (default: the spec's metrics.interval, where `trainspec train` writes a record; flax's
examples log every `log_every_steps`). Each line's round is paired with a plain-jit round next
to it, before or after in turn, and the lines' order swaps every round, so that machine drift
hits both sides of a ratio; a round times `--steps` steps ended by one `block_until_ready`, in
wall time and in this process's CPU time (all its threads: host dispatch and XLA's compute
alike; on a loaded machine the CPU time is the steadier of the two, as waiting for a core does
not count). Prints the median ms/step of each, the median of the per-pair ratios with a 90% bootstrap
interval (how far that median could move with other rounds on this machine), and the load
average (the machine may be shared).
    python bench/wrap_overhead.py [--devices 1 8] [--rounds 15] [--steps 20] [--lines rollback ...]
        [--log-every K]
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import subprocess
import sys
import time

BATCH = 128


def _measure(n_devices: int, rounds: int, steps: int, only: list[str],
             log_every: int | None) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training import train_state
    from jax.sharding import NamedSharding, PartitionSpec as P

    import trainspec.jax
    from trainspec.core import bad_steps
    from trainspec.jax.health import nan as nan_guard

    class ConvNet(nn.Module):
        """Two conv/pool stages and two dense layers: the usual MNIST-sized classifier."""

        @nn.compact
        def __call__(self, images):
            h = images
            for width in (32, 64):
                h = nn.relu(nn.Conv(width, kernel_size=(3, 3))(h))
                h = nn.avg_pool(h, window_shape=(2, 2), strides=(2, 2))
            h = nn.relu(nn.Dense(256)(h.reshape(h.shape[0], -1)))
            return nn.Dense(10)(h)

    model, optimizer = ConvNet(), optax.sgd(0.05, momentum=0.9)

    def create_state(key):
        params = model.init(key, jnp.zeros((1, 28, 28, 1)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optimizer)

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["image"])
            one_hot = jax.nn.one_hot(batch["label"], 10)
            return optax.softmax_cross_entropy(logits, one_hot).mean(), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
        return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}

    rng = np.random.default_rng(0)
    batches = [{"image": rng.random((BATCH, 28, 28, 1), np.float32),
                "label": rng.integers(0, 10, BATCH).astype(np.int32)} for _ in range(4)]

    mesh = jax.make_mesh((n_devices,), ("data",))
    on_data = NamedSharding(mesh, P("data"))

    def meeting_step(state, batch):
        new_state, metrics = train_step(state, batch)
        leaves = [x for x in jax.tree.leaves(new_state) if jnp.issubdtype(x.dtype, jnp.floating)]
        meet = jax.shard_map(lambda xs: jax.lax.psum(sum(x.ravel()[0] for x in xs), "data"),
                             mesh=mesh, in_specs=([P()] * len(leaves),), out_specs=P(),
                             check_vma=False)
        return new_state, {**metrics, "meeting": meet(leaves)}

    def flags_step(state, batch):
        new_state, metrics = train_step(state, batch)
        leaves = [x for x in jax.tree.leaves(new_state) if jnp.issubdtype(x.dtype, jnp.floating)]
        specs = [P()] * len(leaves)  # replicated: each device checks 1/n of every leaf
        on = jax.sharding.get_abstract_mesh()  # the wrapped step's mesh
        flags = jax.shard_map(lambda xs: nan_guard._bad_slices(xs, specs, on)[None], mesh=on,
                              in_specs=(specs,), out_specs=P(on.axis_names),
                              check_vma=False)(leaves)
        return new_state, {**metrics, "flags": flags}

    def flags_read_late():
        """The state checked after every step: each step's flags (this process's devices')
        and loss read as late as the rollback line reads its verdicts."""
        pending = bad_steps.PendingVerdicts()

        def judge(at, metrics, now):
            pending.add(at, ([s.data for s in metrics["flags"].addressable_shards],
                             metrics["loss"]))
            for _, inputs in pending.due(now):
                flags, loss = jax.device_get(inputs)
                if np.any(flags) or not np.isfinite(loss):
                    bad_verdicts.append("flags: a non-finite state or loss")

        return judge

    def copy_step(state, batch):
        new_state, metrics = train_step(state, batch)
        keep = jnp.isfinite(metrics["loss"])
        return jax.lax.cond(keep, lambda: new_state, lambda: state), metrics

    def judged_late(step, **timing):
        """What trainspec.core.run does after each step under rollback: the verdicts that are
        due (bad_steps.PendingVerdicts, `timing` its lag and batch; all of them at a record)
        read and judged (a bad one is only counted: there is no checkpoint to roll back to)."""
        spikes = bad_steps.LossSpikes(spec.health.spikes)
        pending = bad_steps.PendingVerdicts(**timing)

        def judge(at, metrics, now):
            pending.add(at, step.verdict_inputs(metrics))
            bad = bad_steps.bad_verdicts(pending.due(now), step.read_verdicts, spikes)
            bad_verdicts.extend(reason for _, reason in bad)

        return judge

    def loop(step_call, judge=None):
        """A training loop around a step: the step's loss read on the host every `log_every`
        steps (flax's examples log every `log_every_steps`; trainspec's run loop records
        every `metrics.interval`), and `judge(at, metrics, logs)` after each step, if any."""
        steps_done = itertools.count(1)

        def call(state, batch):
            state, metrics = step_call(state, batch)
            at = next(steps_done)
            logs = log_every > 0 and at % log_every == 0
            if judge is not None:
                judge(at, metrics, logs)
            if logs:
                jax.device_get(metrics["loss"])
            return state, metrics

        return call

    def plain_jit(step_fn):
        jitted = jax.jit(step_fn, donate_argnums=0)
        return lambda state, batch: jitted(state, jax.device_put(batch, on_data))

    bad_verdicts: list[str] = []
    spec = trainspec.load_spec({"batch": {"global_batch": BATCH}})
    skip = trainspec.load_spec(spec, ["health.nan.policy=skip"])
    log_every = spec.metrics.interval if log_every is None else log_every
    wrapped = {"rollback": trainspec.jax.wrap(train_step, spec),
               "skip": trainspec.jax.wrap(train_step, skip),
               "each": trainspec.jax.wrap(train_step, spec),
               "unguarded": trainspec.jax.wrap(train_step, spec, nan_guard=False),
               "flags": trainspec.jax.wrap(flags_step, spec, nan_guard=False)}
    raw = {"plain": train_step, "meeting": meeting_step, "copy": copy_step}
    judges = {"rollback": judged_late(wrapped["rollback"]),
              "each": judged_late(wrapped["each"], batch=1), "flags": flags_read_late()}
    calls = {name: loop(plain_jit(fn)) for name, fn in raw.items()}
    calls.update({name: loop(step, judges.get(name)) for name, step in wrapped.items()})
    states = {name: step.init(create_state, jax.random.key(0)) for name, step in wrapped.items()}
    states.update({name: jax.device_put(create_state(jax.random.key(0)),
                                        NamedSharding(mesh, P())) for name in raw})

    def timed_round(name: str) -> tuple[float, float]:
        """(wall, CPU) seconds per step."""
        state, call = states[name], calls[name]
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            state, _ = call(state, batches[i % len(batches)])
        jax.block_until_ready(state)
        states[name] = state
        return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps

    lines = [name for name in calls if name != "plain" and (not only or name in only)]
    for name in ["plain", *lines]:  # compile and warm up
        timed_round(name)
    load_before = open("/proc/loadavg").read().split()[:3]
    # Each line's round is paired with a plain round right before or after it (alternating),
    # so that a ratio compares two runs seconds apart, not the line with a plain run made
    # up to a whole round earlier.
    pairs: dict[str, list[tuple[tuple[float, float], tuple[float, float]]]] = {
        name: [] for name in lines}
    for r in range(rounds):
        for j, name in enumerate(lines if r % 2 == 0 else lines[::-1]):
            if (r + j) % 2 == 0:
                plain = timed_round("plain")
                pairs[name].append((timed_round(name), plain))
            else:
                pairs[name].append((timed_round(name), timed_round("plain")))
    print(f"{n_devices} device(s), {os.cpu_count()} cores, batch {BATCH}, {rounds} rounds x "
          f"{steps} steps, the loss read {f'every {log_every} steps' if log_every else 'never'}; "
          f"load average before "
          f"{load_before}, after {open('/proc/loadavg').read().split()[:3]}")
    if bad_verdicts:
        print(f"  rollback judged {len(bad_verdicts)} step(s) bad (counted, not rolled back), "
              f"first: {bad_verdicts[0]}")
    for i, clock in enumerate(("wall", "CPU")):
        plain = statistics.median(p[i] for name in lines for _, p in pairs[name]) * 1e3
        print(f"  {clock:4s} plain jit {plain:8.2f} ms/step")
        for name in lines:
            ms = statistics.median(w[i] for w, _ in pairs[name]) * 1e3
            ratios = [w[i] / p[i] for w, p in pairs[name]]
            low, high = _median_interval(ratios)
            print(f"       {name:9s} {ms:8.2f} ms/step  /plain: median of pairs "
                  f"{statistics.median(ratios):.3f}x (90% interval {low:.3f} .. {high:.3f}; "
                  f"pairs {min(ratios):.3f} .. {max(ratios):.3f})")


def _median_interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 90% bootstrap interval of the median of `ratios` (the pairs resampled with
    replacement): how far the printed median could move with other rounds of this machine."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(resamples))
    return medians[int(0.05 * resamples)], medians[int(0.95 * resamples) - 1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lines", nargs="+", default=[], metavar="LINE",
                        help="time only these lines against plain jit (default: all)")
    parser.add_argument("--log-every", type=int, default=None, metavar="K",
                        help="every line's loop reads its loss every K steps (default: the "
                             "spec's metrics.interval, 10; 0: never)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.one:  # a child: XLA_FLAGS must be set before jax is imported
        _measure(args.devices[0], args.rounds, args.steps, args.lines, args.log_every)
        return
    for n in args.devices:  # each device count in a fresh process
        subprocess.run([sys.executable, __file__, "--one", "--devices", str(n),
                        "--rounds", str(args.rounds), "--steps", str(args.steps),
                        *(["--lines", *args.lines] if args.lines else []),
                        *(["--log-every", str(args.log_every)] if args.log_every is not None
                          else [])], check=True)


if __name__ == "__main__":
    main()
