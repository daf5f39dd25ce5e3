"""The planner (spec_jax.core.plan) against what compiles and runs here (docs/plan.md).

Every layout the planner accepts for the validation model at 1-8 devices, and 2 processes x 4
devices through the single-process dcn path (mesh.py lays a dcn factor out within one process,
so the compiled program, its memory and its collectives are those of the 2 x 4 job; its DCN
link is in-process here). Each layout is compiled once. The CPU profile is calibrated in the
same run: matmul peak, collective alpha-beta (bench rows), the activation overheads from the
tensor = 1, 2, 4 single-replica layouts, and the achievable fraction and per-program overhead
from the 1-device step at two batch sizes.
Each layout's steps alternate with a compute probe on the same devices; the prediction is
scaled by the probe's slowdown against the profile (the load factor), so that the load of a
shared machine, which changes from minute to minute, does not decide the check (docs/plan.md).
"""
import functools
import json
import math
import os
import statistics

import jax
import pytest

from spec_jax.cli.main import main
from spec_jax.core.plan.hardware import load_profile
from spec_jax.core.plan.model import peak_phase, predict
from spec_jax.core.plan.search import all_layouts
from spec_jax.core.plan.transformer import parameters, shape_for_params
from spec_jax.models.transformer_flops import for_spec
from spec_jax.tools.plan_check import (ComputeProbe, calibrate_cpu, compile_layout,
                                 fit_compute, layout_of, load_factors, paired_step_times)
from spec_jax.core.spec import load_spec

MODEL = ["model.d_model=128", "model.n_heads=8", "model.d_ff=256", "model.n_layers=1",
         "batch.seq_len=32"]
MEMORY_TOL, COMM_TOL = 0.10, 0.02
# On these layouts XLA gathers some weights over fsdp a second time, for the backward: the
# same operand over the same device groups, where on the other layouts one all-gather serves
# both, a choice of XLA's SPMD partitioner (docs/plan.md). The planner gathers once: their
# all-gather is held to [1, 2] x the prediction, and their memory to the tolerance once the
# second copies XLA made (the extra all-gather output its HLO shows) are added.
REGATHERED = {(2, 2, 2), (1, 4, 2)}
CALIBRATION = ((1, 1, 1), (1, 1, 2), (1, 1, 4))  # (data, fsdp, tensor) fitted, not validated
# Step times are printed (PLANROW), not asserted: the 30% target is not shown. Measured here at
# loads of 6-13 per core the same layout's error moved between -79% and +75% from run to run,
# and at CI's load it missed on most rows (docs/plan.md).


def spec_for(data, fsdp, tensor, dcn=1, rows=8):
    shards = data * fsdp
    micro = shards * -(-rows // shards)  # >= `rows` rows, divisible by the batch shards
    return load_spec(None, MODEL + [
        f"mesh.axes.data.size={data}", f"mesh.axes.data.dcn={dcn}", f"mesh.axes.fsdp.size={fsdp}",
        f"mesh.axes.tensor.size={tensor}", f"batch.micro_batch={micro}",
        f"batch.global_batch={2 * micro}"])


def accepted_layouts():
    """(data, fsdp, tensor, dcn) of every layout the planner accepts at 1-8 devices, + 2 x 4."""
    cpu = load_profile("cpu")
    out = []
    for n in range(1, 9):
        for lay in all_layouts(spec_for(1, 1, 1), n, cpu.ici_domain):
            d, f, t = (lay.sizes[a] for a in ("data", "fsdp", "tensor"))
            if not predict(spec_for(d, f, t), lay, cpu, 0, 0).reasons:
                out.append((d, f, t, 1))
    return out + [(2, 1, 4, 2)]


LAYOUTS = accepted_layouts()


def test_parameter_table_matches_the_flax_model():
    import flax.linen as nn

    from spec_jax.models.transformer import Transformer

    spec = spec_for(1, 1, 1)
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
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


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
    assert "rank layout" in capsys.readouterr().out


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


@functools.lru_cache(maxsize=None)
def compiled(layout, rows=8):
    """(runner, compiled memory and comm) of a (data, fsdp, tensor, dcn) layout, once."""
    d, f, t, dcn = layout
    return compile_layout(spec_for(d, f, t, dcn, rows), d * f * t)


REFERENCE = (1, 1, 1, 1)


@pytest.fixture(scope="module")
def profile():
    points = [(spec_for(*c), math.prod(c), compiled(c + (1,))[1]["memory_peak_bytes"])
              for c in CALIBRATION]
    cpu = calibrate_cpu(load_profile("cpu"), points)
    # achievable fraction and per-program overhead: the 1-device step at 8 and 24 rows (the
    # same program, three times the work), each timed alongside the 1-device probe
    points, probes = [], []
    for rows in (8, 24):
        pairs = paired_step_times(compiled(REFERENCE, rows)[0], probe(1))
        step_s, probe_s = (statistics.median(x) for x in zip(*pairs))
        points.append((_predict(spec_for(1, 1, 1, rows=rows), 1, cpu), step_s))
        probes.append(probe_s)
    return fit_compute(cpu, points), statistics.fmean(probes)


@functools.lru_cache(maxsize=None)
def probe(n):
    return ComputeProbe(n)


def _predict(spec, n, profile):
    f = for_spec(spec)
    return predict(spec, layout_of(spec, n), profile, f.model_per_token(), f.hardware_per_token())


def _comm_errors(predicted: dict, hlo: dict) -> dict:
    keys = {(k, a) for k, v in {**predicted, **hlo}.items() for a in {**predicted.get(k, {}), **hlo.get(k, {})}}
    return {f"{k}@{a}": predicted.get(k, {}).get(a, 0.0) / hlo.get(k, {}).get(a, 1e-9) - 1 for k, a in keys}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "d{}f{}t{}dcn{}".format(*l))
def test_prediction_within_tolerance(layout, profile):
    profile, calibration_probe_s = profile
    d, f, t, dcn = layout
    spec = spec_for(d, f, t, dcn)
    runner, got = compiled(layout)
    pred = _predict(spec, d * f * t, profile)
    assert pred.fits, pred.reasons
    # an all-reduce over no mesh axis (the NaN guard's count on one device) moves nothing
    hlo = {k: {a: b for a, b in v.items() if a != "none"}
           for k, v in got["comm_bytes_by_kind_and_axis"].items()}
    hlo = {k: v for k, v in hlo.items() if v}
    comm = _comm_errors(pred.comm_by_kind_and_axis(), hlo)
    regathered = 0.0
    if (d, f, t) in REGATHERED:
        gathered = comm.pop("all-gather@fsdp")
        assert -0.5 <= gathered < 0, gathered  # predicted / measured - 1: measured 1-2x
        regathered = hlo["all-gather"]["fsdp"] - pred.comm_by_kind_and_axis()["all-gather"]["fsdp"]
    assert all(abs(e) <= COMM_TOL for e in comm.values()), comm
    mem = (pred.memory_bytes + regathered) / got["memory_peak_bytes"] - 1
    pairs = paired_step_times(runner, probe(d * f * t))
    loads = load_factors(profile, d * f * t, [p for _, p in pairs], calibration_probe_s)
    # each step against the prediction at its own pair's load; the median of those ratios
    time = statistics.median(pred.step_time_s * load / s for (s, _), load in zip(pairs, loads)) - 1
    step_s, load = statistics.median(s for s, _ in pairs), statistics.median(loads)
    print(f"PLANROW d={d} f={f} t={t} dcn={dcn} mem {pred.memory_bytes:.0f}/{got['memory_peak_bytes']} "
          f"({mem:+.3f}, +{regathered:.0f} regathered, peak phase {peak_phase(pred.memory)}) comm worst {max(map(abs, comm.values()), default=0):.4f} time "
          f"{pred.step_time_s * load * 1e3:.1f}/{step_s * 1e3:.1f} ms ({time:+.3f}, load factor "
          f"{load:.2f}) loadavg {os.getloadavg()[0]:.1f}")
    if (d, f, t) not in CALIBRATION:
        assert abs(mem) <= MEMORY_TOL, (pred.memory, got["memory_peak_bytes"])
