"""Tokens/s and step time of JAX and PyTorch on the same spec and the same device count.

    python bench/frameworks.py [STEPS] [DEVICES] [--set KEY=VALUE ...]

Runs `trainspec train` twice, one after the other, with the same spec and flags: JAX on DEVICES
simulated CPU devices in one process, torch on DEVICES gloo ranks. Reads both summaries (means
over every recorded step, the first step excluded as it is in each loop's own summary) and
prints them with their ratio and the load average before and after.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _train(run_dir: Path, steps: int, devices: int, sets: list[str], framework: str) -> dict:
    extra = (["--framework", "torch", "--nprocs", str(devices)] if framework == "torch"
             else ["--host-devices", str(devices)])
    cmd = [sys.executable, "-m", "trainspec.cli.main", "train", *extra, "--quiet",
           "--steps", str(steps), "--run-dir", str(run_dir), "--summary-json",
           str(run_dir / "summary.json"), "--set", "checkpoint.interval=0", *sets]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(steps: int = 30, devices: int = 4, sets: list[str] = ()) -> None:
    sets = [a for s in sets for a in ("--set", s)]
    before = _load()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {fw: _train(Path(tmp) / fw, steps, devices, sets, fw) for fw in ("jax", "torch")}
    print(f"default spec{' ' + ' '.join(sets) if sets else ''}, {steps} steps, {devices} devices "
          f"(load average before {before}, after {_load()})")
    for fw, s in runs.items():
        print(f"  {fw:6s} {s['tokens_per_s']:9.0f} tokens/s  {s['step_time_s'] * 1e3:8.1f} ms/step  "
              f"final loss {s['final_loss']:.4f}")
    ratio = runs["torch"]["tokens_per_s"] / runs["jax"]["tokens_per_s"]
    print(f"  torch / jax tokens/s = {ratio:.3f}x")


if __name__ == "__main__":
    args = sys.argv[1:]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    plain = [a for i, a in enumerate(args) if a != "--set" and (i == 0 or args[i - 1] != "--set")]
    main(*(int(a) for a in plain), sets=sets)
