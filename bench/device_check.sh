#!/usr/bin/env bash
# Prepared GPU check (docs/plan.md, "GPU check"): on a machine with jax[cuda] preinstalled and no
# network, install this checkout, run `trainspec doctor`, `trainspec plan` for one GPU, and
# `trainspec train` of a ~127M-parameter reference model in bfloat16 on one GPU; print the
# measured MFU next to the plan's prediction; then time wrap() and the non-finite guard's two
# parts against plain jax.jit on the GPU (bench/wrap_overhead.py). Budget: 8 minutes in all: the
# stage timeouts (install 90 s, doctor 120 s, plan 30 s, train 180 s, wrap 60 s) add up to 8.
#   bash bench/device_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$OUT"
T0=$(date +%s)
PY=${PYTHON:-$(command -v python || command -v python3)}  # images with jax[cuda] may ship only python3
stage() { echo "== $1 ($(( $(date +%s) - T0 )) s)"; }

stage "install (no network: build isolation off, no index)"
TS="$PY -m trainspec.cli.main"  # not `trainspec`: pip's script directory may not be on PATH
if ! timeout 90 "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . >"$OUT/install.log" 2>&1; then
  # no compiler or build deps here: run from the source tree; the xla backend needs no extension
  echo "install failed (tail of $OUT/install.log below); running from the source tree"
  tail -3 "$OUT/install.log"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - <<'PY' || { echo "missing run-time dependencies (above)"; exit 3; }
import importlib.util, sys
missing = [m for m in ("jax", "flax", "optax", "orbax.checkpoint", "pydantic", "tqdm", "matplotlib")
           if importlib.util.find_spec(m.split(".")[0]) is None]
import jax
print("jax", jax.__version__, "devices", jax.devices())
sys.exit(f"missing: {missing}" if missing else 0)
PY

GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$GPU" in
  *H200*) HW=h200 ;; *B200*) HW=b200 ;; *H100*) HW=h100_sxm ;; *A100*) HW=a100 ;;
  *) echo "no known GPU profile for '$GPU'; using h100_sxm"; HW=h100_sxm ;;
esac
echo "GPU: ${GPU:-none}; profile $HW"

# ~127M parameters: 18 layers of width 768 (GPT-2-small blocks), byte vocabulary, 1024 tokens.
MODEL=(--set model.n_layers=18 --set model.d_model=768 --set model.n_heads=12 --set model.d_ff=3072
       --set batch.seq_len=1024 --set batch.global_batch=16 --set batch.micro_batch=16
       --set precision.compute=bfloat16 --set precision.param=float32 --set precision.grad_reduce=float32
       --set mesh.axes.data.size=1 --set checkpoint.interval=0 --set metrics.interval=10)

stage "doctor"
timeout 120 $TS doctor --hardware "$HW" --backends xla --json "$OUT/doctor.json" | tee "$OUT/doctor.txt"
echo "doctor exit status ${PIPESTATUS[0]}"

stage "plan"
timeout 30 $TS plan --devices 1 --hardware "$HW" "${MODEL[@]}" --json "$OUT/plan.json" | tee "$OUT/plan.txt"

stage "train"
timeout 180 $TS train "${MODEL[@]}" --steps 60 --quiet --run-dir "$OUT/run" \
  --summary-json "$OUT/summary.json" | tee "$OUT/train.txt"

stage "compare"
"$PY" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
plan = json.load(open(f"{out}/plan.json"))["predictions"][0]
run = json.load(open(f"{out}/summary.json"))
print(f"step time: measured {run['step_time_s'] * 1e3:.1f} ms, planned {plan['step_time_s'] * 1e3:.1f} ms")
print(f"MFU:       measured {100 * (run['mfu'] or 0):.1f} %, planned {100 * plan['mfu']:.1f} %")
print(f"memory:    compiled {run['memory_peak_bytes'] / 1e9:.2f} GB, planned {plan['memory']['total'] / 1e9:.2f} GB")
PY
stage "wrap"
timeout 60 "$PY" bench/wrap_overhead.py --devices 1 --rounds 15 --steps 20 | tee "$OUT/wrap.txt"

stage "done"
