#!/usr/bin/env bash
# The one GPU script: install the carried wheels, check every kernel against its reference,
# check full-engine parity, then run the benchmarks. Run on the device machine from the repo
# root with `.whl` carried; results land in $OUT (or scripts/results/gpu when OUT is unset).
#   bash scripts/gpu/run.sh [kernels] [anatomy] [parity] [workloads ARGS...]
set -uo pipefail
OUT=${OUT:-scripts/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
[ $# -eq 0 ] && set -- kernels parity workloads
while [ $# -gt 0 ]; do
  case "$1" in
    kernels) python3 scripts/gpu/bench_kernels.py --out "$OUT/kernels.md" || status=1 ;;
    anatomy)
      python3 scripts/gpu/step_anatomy.py --batches 1 64 256 --out "$OUT/anatomy_qwen3.md" || status=1
      python3 scripts/gpu/step_anatomy.py --model scripts/gpu/configs/llama-3.1-8b --batches 1 256 \
        --out "$OUT/anatomy_llama.md" || status=1 ;;
    parity) python3 scripts/gpu/parity.py --out "$OUT/parity.md" || status=1 ;;
    workloads) shift; python3 scripts/gpu/bench_workloads.py --out "$OUT/workloads.md" "$@" || status=1; break ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
  shift
done
exit $status
