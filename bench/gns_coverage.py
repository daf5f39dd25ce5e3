"""The run's GNS estimate scored against held-out gradients over the window it measures, from a
dump of bench/gns_heldout.py (`--dump`, held-out parts at every state of a range).

At each checked step s the record's estimate (trainspec.core.gns.estimate over steps 1..s) is
the ratio of the two-batch parts' means over its window, steps s-K+1..s, which measured the
states after s-K .. s-1 updates. The held-out value over the window is the same ratio of the
held-out parts' means over those states, the quantity the window estimates; the held-out value
at the newest state (after s updates) is printed beside it.
    python bench/gns_coverage.py PARTS.json [--check 20:60]
"""
import argparse
import json

import numpy as np

from trainspec.core.gns import estimate


def steps_arg(text: str) -> list[int]:
    first, last = map(int, text.split(":"))
    return list(range(first, last + 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dump")
    p.add_argument("--check", type=steps_arg, default=None,
                   help="steps to check (default: every step whose window has held-out parts)")
    args = p.parse_args()
    dump = json.load(open(args.dump))
    parts = np.asarray(dump["run_parts"], np.float64)
    held = {int(k): (v["grad_sq"], v["trace"]) for k, v in dump["held_out"].items()}
    fmt = lambda v: "inf" if v is None else f"{v:,.0f}"  # noqa: E731
    rows, covered, close, newest_covered = [], 0, 0, 0
    for s in args.check or range(2, dump["steps"] + 1):
        e = estimate(*parts[:s].T)
        states = range(s - e.window, s)  # the states the window's steps measured
        if not all(t in held for t in states) or e.b_simple is None:
            continue
        g, t = np.mean([held[t] for t in states], axis=0)
        window_value = t / g
        inside = (e.low or 0) <= window_value <= (e.high or np.inf)
        near = abs(e.b_simple / window_value - 1) <= 0.3
        covered, close = covered + inside, close + near
        newest = held[s][1] / held[s][0]
        newest_covered += (e.low or 0) <= newest <= (e.high or np.inf)
        rows.append(f"| {s} | {e.window} | {fmt(e.b_simple)} | {fmt(e.low)}–{fmt(e.high)} | "
                    f"{fmt(window_value)} | {'yes' if inside else 'no'} | "
                    f"{e.b_simple / window_value:.2f} | {fmt(newest)} |")
    print("| step | window (steps) | estimate (tokens) | 90 % interval | held-out over the "
          "window | covered? | estimate / held-out | held-out at the newest state |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    n = len(rows)
    print(f"\ncovered at {covered} of {n} states ({covered / n:.0%}); estimate within 30 % of "
          f"the held-out value over its window at {close} of {n} ({close / n:.0%}); the "
          f"interval holds the newest state's own held-out value at {newest_covered} of {n}")


if __name__ == "__main__":
    main()
