"""Step time with a metrics record at every step against no metrics at all (target <= 1.03x).

Both loops run the same compiled step of the default job (8 simulated CPU devices), in
alternating rounds so that machine drift hits both; each round times ROUND_STEPS steps ended by
one block_until_ready. "none": the bare loop. "every step": MetricsLogger with interval 1, i.e.
a host sync, a record and a JSONL write per step. Prints the median per-step times and ratio.
    python bench/metrics_overhead.py [ROUNDS] [ROUND_STEPS]
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402

from trainspec.core.transformer_flops import for_spec  # noqa: E402
from trainspec.jax.metrics.logger import MetricsLogger  # noqa: E402
from trainspec.core.spec import default_spec, load_spec  # noqa: E402
from trainspec.jax.train import build_job  # noqa: E402


def main(rounds: int = 5, round_steps: int = 10) -> None:
    spec = load_spec(default_spec(), ["metrics.interval=1"])
    total = 2 * rounds * round_steps + 2
    job = build_job(spec, total_steps=total)
    work = tempfile.TemporaryDirectory()  # the metrics file is not the result: removed at the end
    run_dir = Path(work.name)
    logger = MetricsLogger.for_run(spec, job.step, job.state, job.data.batch(0), run_dir, total,
                                   for_spec(spec))
    state, step = job.state, 0
    batches = [job.data.batch(i) for i in range(round_steps)]  # input off the clock for both

    def run(with_metrics: bool) -> float:
        nonlocal state, step
        logger.start()
        t = time.perf_counter()
        for batch in batches:
            step += 1
            state, metrics = job.step(state, batch)
            if with_metrics:
                logger.after_step(step, metrics, 0.0)
        jax.block_until_ready(state)
        return (time.perf_counter() - t) / round_steps

    run(False), run(True)  # warm-up
    times = {False: [], True: []}
    for _ in range(rounds):
        for mode in (False, True):
            times[mode].append(run(mode))
    none, every = statistics.median(times[False]), statistics.median(times[True])
    print(f"devices {jax.device_count()} ({jax.devices()[0].platform}), {os.cpu_count()} cores, "
          f"default job, {rounds} rounds x {round_steps} steps each")
    print(f"no metrics:        {none * 1e3:8.2f} ms/step  (rounds: {[round(t * 1e3, 1) for t in times[False]]})")
    print(f"record every step: {every * 1e3:8.2f} ms/step  (rounds: {[round(t * 1e3, 1) for t in times[True]]})")
    print(f"ratio: {every / none:.4f}x (target <= 1.03x)")
    logger.close()
    work.cleanup()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
