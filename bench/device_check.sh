#!/usr/bin/env bash
# Prepared GPU check (docs/xla_ext.md, "On a GPU"; docs/plan.md, "GPU check"): on a machine with
# one GPU, jax[cuda] and torch preinstalled and no network, in at most 8 minutes:
#   1. install this checkout with the CUDA handlers (TRAINSPEC_CUDA=ON: nvcc must be there);
#   2. run the xla_ext kernels on the GPU against NumPy and measure pack/quantize bandwidth at
#      256 MiB against the card's HBM peak (bench/gpu_kernels.py);
#   3. `trainspec plan` and `trainspec train` of a ~350M-parameter reference model in bfloat16 on
#      the GPU (MFU, step time, next to the plan's), then the same model with --framework torch;
#   4. wrap() and the non-finite guard against plain jax.jit on the GPU (bench/wrap_overhead.py);
# and print one table (bench/device_check_table.py). Stage timeouts: install 150 s, kernels 60 s,
# plan 20 s, train 100 s, torch 90 s, wrap 50 s: 470 s.
#   bash bench/device_check.sh [--dry-run] [OUT_DIR]
# --dry-run: on any machine (CPU), with the installed environment, a tiny model and small sizes:
# every stage's code path, in a minute or two (tests/cli/test_device_check.py runs it).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$OUT"
T0=$(date +%s)
PY=${PYTHON:-$(command -v python || command -v python3)}  # images with jax[cuda] may ship only python3
TS="$PY -m trainspec.cli.main"  # not `trainspec`: pip's script directory may not be on PATH
stage() { echo "== $1 ($(( $(date +%s) - T0 )) s)"; }

# ~350M parameters: 28 layers of width 1024 (GPT-2-medium blocks), byte vocabulary, 1024 tokens.
MODEL=(--set model.n_layers=28 --set model.d_model=1024 --set model.n_heads=16 --set model.d_ff=4096
       --set batch.seq_len=1024 --set batch.global_batch=8 --set batch.micro_batch=8
       --set precision.compute=bfloat16 --set precision.param=float32 --set precision.grad_reduce=float32
       --set mesh.axes.data.size=1 --set checkpoint.interval=0 --set metrics.interval=10)
STEPS=30 HW= KERNELS=() WRAP=(--rounds 10 --steps 10) HOST=()
if [ $DRY = 1 ]; then
  MODEL+=(--set model.n_layers=2 --set model.d_model=64 --set model.n_heads=4 --set model.d_ff=128
          --set batch.seq_len=64 --set precision.compute=float32)
  STEPS=3 KERNELS=(--dry-run) WRAP=(--rounds 2 --steps 5) HOST=(--host-devices 1)
else
  stage "install with the CUDA handlers (no network: build isolation off, no index)"
  if ! timeout 150 "$PY" -m pip install --no-build-isolation --no-deps --no-index \
      -C cmake.define.TRAINSPEC_CUDA=ON -e . >"$OUT/install.log" 2>&1; then
    echo "install failed (tail of $OUT/install.log below): the kernel rows will say so"
    tail -5 "$OUT/install.log"
  fi
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "$GPU" in
    *H200*) HW=h200 ;; *H100*) HW=h100_sxm ;; *B200*) HW=b200 ;; *A100*) HW=a100 ;;
    *) echo "no known GPU profile for '$GPU'; using h100_sxm"; HW=h100_sxm ;;
  esac
  echo "GPU: ${GPU:-none}; profile $HW"
fi

stage "kernels"
timeout 60 "$PY" bench/gpu_kernels.py --json "$OUT/kernels.json" "${KERNELS[@]}" \
  >"$OUT/kernels.txt" 2>&1 || tail -3 "$OUT/kernels.txt"

stage "plan"
timeout 20 $TS plan --devices 1 --hardware "${HW:-cpu}" "${MODEL[@]}" --json "$OUT/plan.json" \
  >"$OUT/plan.txt" 2>&1 || tail -3 "$OUT/plan.txt"

stage "train (JAX)"
timeout 100 $TS train "${MODEL[@]}" --steps $STEPS --quiet --run-dir "$OUT/run" "${HOST[@]}" \
  --summary-json "$OUT/summary.json" >"$OUT/train.txt" 2>&1 || tail -3 "$OUT/train.txt"

stage "train (torch)"
timeout 90 $TS train --framework torch --nprocs 1 "${MODEL[@]}" --steps $STEPS --quiet \
  --run-dir "$OUT/run_torch" --summary-json "$OUT/summary_torch.json" >"$OUT/torch.txt" 2>&1 \
  || tail -3 "$OUT/torch.txt"

stage "wrap"
timeout 50 "$PY" bench/wrap_overhead.py --devices 1 "${WRAP[@]}" >"$OUT/wrap.txt" 2>&1 \
  || tail -3 "$OUT/wrap.txt"

stage "done"
"$PY" bench/device_check_table.py "$OUT"
