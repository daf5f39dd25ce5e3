"""The planner (trainspec.core.plan) on paper: its parameter table against the flax model, the
CLI's output and bad input, the --params shape rule, and the calibration fits on exact,
made-up measurements (docs/plan.md). Memory and communication against compiled programs:
tests/jax/test_plan_compiled.py. Step time is a benchmark, bench/plan_step_time.py, which measures
what calibrates it.
"""
import dataclasses
import json
import math
from pathlib import Path

import jax
import pytest

from trainspec.cli.main import main
from trainspec.core.errors import UserInputError
from trainspec.core.plan.hardware import Link, calibrate, load_profile
from trainspec.core.plan.transformer import parameters, shape_for_params
from trainspec.core.spec import load_spec
from trainspec.jax.tools.plan_check import (
    TIME_CALIBRATION, VALIDATION_MODEL, fit_time, predict_for)
from trainspec.jax.tools.plan_check import validation_spec as spec_for


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_parameter_table_matches_the_flax_model(moe):
    import flax.linen as nn

    from trainspec.jax.models.transformer import Transformer

    spec = load_spec(None, VALIDATION_MODEL + (["model.moe.experts=4"] if moe else []))
    model = Transformer(spec.model)
    abstract = jax.eval_shape(model.init, jax.random.key(0), jax.numpy.zeros((1, 8), "int32"))
    logical = nn.get_partition_spec(abstract)["params"]
    flat = {"/".join(k.key for k in path): (leaf.value.shape, tuple(spec_))
            for (path, leaf), spec_ in zip(jax.tree_util.tree_leaves_with_path(
                abstract["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)),
                jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))}
    assert flat == {p.path: (p.shape, p.logical) for p in parameters(spec.model)}


@pytest.mark.parametrize("argv, says", [
    (["--devices", "8", "--hardware", "nope"], "unknown hardware"),
    (["--devices", "8", "--set", "mesh.axes.tensor.size=16"], "does not divide --devices 8"),
    (["--devices", "8", "--hardware", "h100_sxm", "--layers", "200", "--d-model", "16384",
      "--heads", "128", "--d-ff", "65536"], "exceeds the 80 GB"),
    (["--devices", "8", "--params", "1e9", "--d-model", "512"], "cannot be combined with --d-model"),
    (["--devices", "8", "--params", "1000"], "--params: 1e+03 is outside the sizes"),
    (["--devices", "8", "--params", "nan"], "--params: nan is outside the sizes"),
    (["--devices", "8", "--top", "0"], "argument --top: expected an integer >= 1"),
    (["--devices", "8", "--devices-per-host", "0"], "--devices-per-host: expected an integer"),
    (["--devices", "8", "--peak-flops", "-1"], "--peak-flops must be a positive FLOP/s"),
    ([], "--devices is required (or --published NAME)"),
    (["--published", "gpt-5"], "--published: unknown 'gpt-5'; known: llama3-405b-8k"),
    (["--published", "deepseek-v3", "--devices", "8", "--set", "batch.seq_len=8"],
     "cannot be combined with --devices, --set"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_published_layout_with_its_mfu_and_json(tmp_path, capsys):
    out = tmp_path / "llama.json"
    assert main(["plan", "--published", "llama3-405b-8k", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "on 16,384 h100_sxm: tensor 8 x pipeline 16 x data 128" in text and ": fits" in text
    saved = json.loads(out.read_text())
    assert saved["fits"] and 0.75 * 0.38 <= saved["mfu"] <= 1.25 * 0.43
    assert f"MFU {100 * saved['mfu']:.1f}%" in text


def test_ranked_table_json_and_plot_from_8_to_100k_devices(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--devices", "64", "--hardware", "h100_sxm", "--all-layouts",
                 "--layers", "4", "--d-model", "512", "--heads", "8", "--d-ff", "2048",
                 "--json", str(out), "--plot", str(png)]) == 0
    preds = json.loads(out.read_text())["predictions"]
    fitting = [p for p in preds if p["fits"]]
    assert fitting and all(a["step_time_s"] <= b["step_time_s"] for a, b in zip(fitting, fitting[1:]))
    assert all(p["reasons"] for p in preds if not p["fits"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "rank layout" in out and "as XLA:GPU compiles the step" in out  # the backend modelled


def test_context_sizes_ranked_with_the_other_axes_on_the_cpu_profile(tmp_path, capsys):
    """--all-layouts sizes the spec's context axis too: every context x data split of 8
    devices is planned (memory and ring bytes growing with the context size, the batch
    replicated over it), and a pipeline beside it is refused by name. Elsewhere than the cpu
    profile the reference model's context layouts are refused, naming the planner that
    models them."""
    out = tmp_path / "plan.json"
    example = str(Path(__file__).parents[2] / "examples" / "context.toml")
    assert main(["plan", "--spec", example, "--devices", "8", "--hardware", "cpu",
                 "--all-layouts", "--json", str(out)]) == 0
    preds = {(p["layout"]["pipeline"], p["layout"]["context"]): p
             for p in json.loads(out.read_text())["predictions"]}
    ring = [preds[(1, c)]["comm_bytes_by_kind_and_axis"].get("collective-permute", {})
            .get("context", 0.0) for c in (1, 2, 4, 8)]
    memory = [preds[(1, c)]["memory"]["total"] for c in (1, 2, 4, 8)]
    assert all(preds[(1, c)]["fits"] for c in (1, 2, 4, 8))
    assert ring[0] == 0 and ring[1] < ring[2] < ring[3] and memory == sorted(memory)
    assert "mesh pipeline beside context" in preds[(2, 4)]["reasons"][0]
    capsys.readouterr()
    assert main(["plan", "--spec", example, "--devices", "8", "--hardware", "h100_sxm"]) == 2
    assert "trainspec.core.plan.sharded_decoder" in capsys.readouterr().err


@pytest.mark.parametrize("n", [125e6, 1.3e9, 8e9, 175e9, 1e12])
def test_params_picks_a_shape_of_about_that_size(n):
    m = shape_for_params(n, load_spec(None).model)
    count = sum(p.size for p in parameters(m))
    # the nearest multiple of 128 in width at the rule's layer count: within one width step
    assert abs(count / n - 1) <= 0.1, (m, count)
    assert 0.75 <= m.d_model / (128 * m.n_layers) <= 1.25 and m.d_model == 128 * m.n_heads == m.d_ff // 4


def test_params_rule_gives_gpt3_its_own_shape():
    m = shape_for_params(175e9, load_spec(None, ["model.vocab_size=51200"]).model)
    assert (m.n_layers, m.d_model, m.n_heads, m.d_ff) == (96, 12288, 96, 49152)


def test_params_flag_plans_that_model(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--devices", "8", "--hardware", "h100_sxm", "--params", "1.3e9",
                 "--vocab", "51200", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    model = load_spec(plan["spec"]).model
    assert (model.n_layers, model.vocab_size) == (18, 51200)
    assert sum(p.size for p in parameters(model)) == pytest.approx(1.3e9, rel=0.1)
    assert plan["predictions"][0]["fits"]


def test_calibrate_fits_link_and_peak_from_bench_rows():
    """`plan --calibrate`: bench rows made from a known link give it back (least squares on
    exact points), every dtype gets the matmul peak, and the per-peer latency is the profile's."""
    cpu, link, group = load_profile("cpu"), Link(20e-6, 5e9), 8
    factor = 2 * (group - 1) / group  # all_reduce's bus factor: busbw / algbw
    rows = [{"op": "all_reduce", "backend": "xla", "size_bytes": size,
             "time_us": link.time(size * factor) * 1e6, "algbw_gbps": 1.0, "busbw_gbps": factor}
            for size in (16 << 10, 256 << 10, 1 << 20, 4 << 20)]
    got = calibrate(cpu, rows + [{**rows[0], "backend": "ext", "time_us": 1.0}], 1e11)
    assert got.ici.alpha_s == pytest.approx(20e-6, rel=1e-6)
    assert got.ici.bandwidth_Bps == pytest.approx(5e9, rel=1e-6)
    assert got.ici.alpha_per_peer_s == cpu.ici.alpha_per_peer_s
    assert set(got.peak_flops.values()) == {1e11} and got.peak_flops.keys() == cpu.peak_flops.keys()
    with pytest.raises(UserInputError, match="2\\+ sizes"):
        calibrate(cpu, rows[:1])


def test_fit_time_recovers_the_step_time_parameters():
    """The step-time fit (bench/plan_step_time.py measures the steps; the fit is checked here on
    exact ones): steps predicted with known parameters give those parameters back."""
    cpu = load_profile("cpu")
    ici = dataclasses.replace(cpu.ici, alpha_s=0.0, alpha_per_peer_s=40e-6)
    true = dataclasses.replace(cpu, achievable_fraction=0.3, program_overhead_s=2e-3, ici=ici,
                               dcn=ici, memory_bandwidth_Bps=10e9)
    seconds = [predict_for(spec_for(*c), math.prod(c[:3]), true).step_time_s
               for c in TIME_CALIBRATION]
    start = dataclasses.replace(true, achievable_fraction=0.7, program_overhead_s=0.0,
                                ici=dataclasses.replace(ici, alpha_per_peer_s=0.0))
    got = fit_time(start, seconds)
    assert got.achievable_fraction == pytest.approx(0.3, rel=1e-6)
    assert got.program_overhead_s == pytest.approx(2e-3, rel=1e-6)
    assert got.ici.alpha_per_peer_s == pytest.approx(40e-6, rel=1e-6)
