"""`trainspec advise` and `trainspec scaling` are framework-free: they run where jax cannot be
imported (a torch-only install), their plots included. Each runs in a fresh process whose
`import jax` (and flax, optax, orbax, jaxlib) raises, as on an install without the extra."""
import json
import os
import subprocess
import sys

import hand_records

JAX_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax")


def _without_jax(tmp_path) -> dict:
    blocked = tmp_path / "blocked"
    for name in JAX_PACKAGES:
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    return {**os.environ, "PYTHONPATH": str(blocked)}


def _trainspec(tmp_path, *argv):
    return subprocess.run([sys.executable, "-m", "trainspec.cli.main", *argv], cwd=tmp_path,
                          capture_output=True, text=True, env=_without_jax(tmp_path), timeout=300)


def test_the_block_works(tmp_path):
    """The same environment refuses a command that needs jax, naming the extra."""
    from trainspec.core.spec import DEFAULT_SPEC_PATH

    done = _trainspec(tmp_path, "validate", str(DEFAULT_SPEC_PATH))
    assert done.returncode == 2, done.stderr
    assert "pip install 'trainspec[jax]'" in done.stderr, done.stderr


def test_advise_runs_without_jax(tmp_path):
    records = tmp_path / "metrics.jsonl"
    base = {"loss": 3.0, "step_time_s": 0.1, "n_devices": 8, "batch_tokens": 32 * 128,
            "gns_source": "replicas", "gns_window_steps": 5, "gns_trend_limited": False}
    records.write_text("".join(json.dumps(hand_records.record(
        s, **base, gns=g, gns_low=g / 1.2, gns_high=g * 1.2)) + "\n"
        for s, g in zip((5, 10, 15, 20), (2e3, 4e3, 6e3, 8e3))))
    done = _trainspec(tmp_path, "advise", str(records), "--plot", str(tmp_path / "a.png"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "critical batch B_crit = 8000 tokens" in done.stdout
    assert (tmp_path / "a.png").stat().st_size > 0


def test_scaling_runs_without_jax(tmp_path):
    for n in (1e5, 4e5, 1.6e6):
        for d in (8e3, 16e3, 32e3):
            run = tmp_path / "sweep" / f"n{n:g}_d{d:g}"
            run.mkdir(parents=True)
            (run / "scaling.json").write_text(json.dumps({
                "params": n, "tokens": d, "compute": 6 * n * d,
                "loss": 1.7 + 400 / n**0.34 + 410 / d**0.28}))
    done = _trainspec(tmp_path, "scaling", str(tmp_path / "sweep"), "--bootstrap", "10",
                      "--predict-compute", "1e13", "--plot", str(tmp_path / "fit.png"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "predicted loss (compute)" in done.stdout
    assert (tmp_path / "fit.png").stat().st_size > 0
