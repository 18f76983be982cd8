#!/usr/bin/env bash
# One GPU call that measures session 36's candidate for the CUDA quantized GEMV
# (scripts/results/session36/quant_gemv_candidate.patch: two MMA chains at M <= 8, step-major
# weights accepted by the binding, an optional per-warp step rotation) against HEAD's kernel.
#   bash scripts/gpu/quant_ab.sh          (from the repo root on the device, `.whl` carried; ~8 min)
# Candidate: patch csrc/, build, weight-layout A/B (quant_layout_ab.py: rows, rows rotated,
# step-major), every check_quant_cuda check plus Llama-8B int4 / fp8 timing at M = 1 and 4, and
# ncu of int4 gate_up at M = 1. Baseline: patch reverted, build, the same timing at M = 1.
# Each report is written to $OUT as it finishes.
set -uo pipefail
OUT=${OUT:-scripts/results/gpu}; mkdir -p "$OUT"
PATCH=scripts/results/session36/quant_gemv_candidate.patch
export PYTHONPATH=/tmp/site:$PWD PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > "$OUT/gpu.txt"
START=$SECONDS
patch -p1 < "$PATCH" > "$OUT/patch.log" || exit 1
{ time python3 -m pagedserve.kernels.build; } > "$OUT/build_candidate.log" 2>&1
echo "candidate built at $((SECONDS - START)) s"
timeout 100 python3 scripts/gpu/quant_layout_ab.py --out "$OUT/layout.md" > "$OUT/layout.log" 2>&1
echo "layout A/B at $((SECONDS - START)) s"; grep "32 layers\|checks:" "$OUT/layout.md"
timeout 150 python3 scripts/gpu/check_quant_cuda.py --models llama8b --schemes int4 fp8 \
  --rows 1 4 --time-limit 80 --out "$OUT/quant_candidate.md" > "$OUT/quant_candidate.log" 2>&1
echo "candidate checked at $((SECONDS - START)) s: $(grep -m1 'passed' "$OUT/quant_candidate.md")"
timeout 80 ncu --set full --import-source no -k regex:quant_gemv_kernel --launch-skip 3 \
  --launch-count 1 -f -o "$OUT/ncu" python3 scripts/gpu/ncu_quant_gemv.py > "$OUT/ncu.log" 2>&1
if [ -f "$OUT/ncu.ncu-rep" ]; then
  ncu -i "$OUT/ncu.ncu-rep" --page details --print-details all > "$OUT/ncu_details.txt" 2>&1
  ncu -i "$OUT/ncu.ncu-rep" --page raw --csv > "$OUT/ncu_raw.csv" 2>&1
  ncu -i "$OUT/ncu.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_sass.csv" 2>&1
fi
echo "profiled at $((SECONDS - START)) s"
patch -R -p1 < "$PATCH" >> "$OUT/patch.log" || exit 1
{ time python3 -m pagedserve.kernels.build; } > "$OUT/build_baseline.log" 2>&1
timeout 100 python3 scripts/gpu/check_quant_cuda.py --time-only --models llama8b \
  --schemes int4 fp8 --rows 1 --time-limit 60 --out "$OUT/quant_baseline.md" > "$OUT/quant_baseline.log" 2>&1
echo "baseline timed at $((SECONDS - START)) s"
grep -A4 "32 layers" "$OUT/quant_candidate.md" "$OUT/quant_baseline.md"
