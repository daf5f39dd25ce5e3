"""The GPU check's one table (bench/device_check.sh): every stage's result beside its goal.

Reads what the stages left in OUT_DIR -- kernels.json (bench/gpu_kernels.py), plan.json and
summary.json (`trainspec plan` / `trainspec train`, JAX), summary_torch.json (`trainspec train
--framework torch`), wrap.txt (bench/wrap_overhead.py) -- and prints one row per measurement; a
stage that left nothing is a row saying so.

    python bench/device_check_table.py OUT_DIR
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

MFU_GOAL = 0.50


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _missing(name: str, what: str) -> dict:
    return {"name": name, "result": f"no result ({what})", "goal": "", "ok": False}


def kernel_rows(out: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (out / "kernels.json").read_text().splitlines()]
    except (OSError, ValueError):
        return [_missing("kernels on the device", "see kernels.txt")]


def train_row(name: str, summary: dict | None, plan: dict | None) -> dict:
    if summary is None or summary.get("mfu") is None:
        return _missing(name, "see its log")
    planned = f"; plan {100 * plan['mfu']:.1f}%, {plan['step_time_s'] * 1e3:.1f} ms" if plan else ""
    return {"name": name,
            "result": f"MFU {100 * summary['mfu']:.1f}%, {summary['step_time_s'] * 1e3:.1f} ms/step"
                      f"{planned}",
            "goal": f"MFU >= {100 * MFU_GOAL:.0f}%", "ok": summary["mfu"] >= MFU_GOAL}


def wrap_rows(out: Path) -> list[dict]:
    try:
        text = (out / "wrap.txt").read_text()
    except OSError:
        return [_missing("wrap overhead", "see wrap.txt")]
    found = re.findall(r"^\s+(\S+)\s+([\d.]+) ms/step\s+/plain: median of pairs ([\d.]+)x", text,
                       re.M)
    if not found:
        return [_missing("wrap overhead", "see wrap.txt")]
    # The wall-clock lines come first (then the CPU-time ones).
    rows, seen = [], set()
    for line, ms, ratio in found:
        if line not in seen:
            seen.add(line)
            rows.append({"name": f"wrap overhead: {line} vs plain jit (wall)",
                         "result": f"{float(ratio):.3f}x ({ms} ms/step)", "goal": "report",
                         "ok": True})
    return rows


def rows(out: Path) -> list[dict]:
    plan = _json(out / "plan.json")
    prediction = plan["predictions"][0] if plan else None
    return [*kernel_rows(out),
            train_row("JAX train, ~350M bf16, 1 GPU", _json(out / "summary.json"), prediction),
            train_row("torch train, same model, 1 rank", _json(out / "summary_torch.json"), None),
            *wrap_rows(out)]


def render(table: list[dict]) -> str:
    head = ("check", "result", "goal", "met")
    cells = [head] + [(r["name"], r["result"], r["goal"], "yes" if r["ok"] else "NO")
                      for r in table]
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python bench/device_check_table.py OUT_DIR", file=sys.stderr)
        return 2
    print(render(rows(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
