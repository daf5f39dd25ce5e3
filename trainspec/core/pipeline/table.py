"""The table of docs/pipeline.md: each schedule the core generates, executed (F and B one time
unit each, free transfers), its measured idle fraction beside the formula, and the activations
stage 0 holds at its peak. `python -m trainspec.core.pipeline.table` prints it."""
from __future__ import annotations

from trainspec.core.pipeline.schedule import bubble_formula, run

CASES = [(schedule, p, m, v) for schedule, v in (("gpipe", 1), ("1f1b", 1),
                                                 ("interleaved_1f1b", 2))
         for p in (2, 4, 8) for m in sorted({p, 2 * p, 8})]


def markdown() -> str:
    rows = ["| schedule | p | m | v | measured idle fraction | formula | stage 0 peak activations "
            "(micro-batches of the whole stage) |", "|---|---|---|---|---|---|---|"]
    for schedule, p, m, v in CASES:
        timeline = run(schedule, p, m, v)
        peak = timeline.peak_in_flight()[0] / v
        rows.append(f"| {schedule} | {p} | {m} | {v} | {timeline.idle_fraction():.4f} | "
                    f"{bubble_formula(schedule, p, m, v):.4f} | {peak:g} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
