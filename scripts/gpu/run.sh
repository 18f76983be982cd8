#!/usr/bin/env bash
# The one GPU script: install the carried wheels, check every kernel against its reference,
# check full-engine parity, then run the benchmarks. Run on the device machine from the repo
# root with `.whl` carried; results land in $OUT (or scripts/results/gpu when OUT is unset).
#   bash scripts/gpu/run.sh [kernels] [splits] [probe] [anatomy] [parity] [quant] [quant_cuda]
#                           [structured] [workloads ARGS...]
set -uo pipefail
OUT=${OUT:-scripts/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
# Python's bytecode cache in a writable place: the image's site-packages have no usable .pyc
# (a GPU run's cProfile showed ~1,200 modules compiled from source per process at start-up).
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# Install step: build the compiled kernels of csrc/ (the CUDA decode kernel for this GPU) into
# pagedserve/kernels/_built, as `pip install` / `make install` do: the CUDA decode kernel and,
# from sm_90 on, the CUDA quantized GEMV, which the engine loads (a no-op when already built for
# these sources).
TIMEFORMAT='kernel build (or found built): %R s'
time python3 -m pagedserve.kernels.build ||
  echo "kernel build FAILED: the engine falls back to Triton"
status=0
[ $# -eq 0 ] && set -- kernels parity workloads
while [ $# -gt 0 ]; do
  case "$1" in
    kernels) python3 scripts/gpu/bench_kernels.py --out "$OUT/kernels.md" || status=1 ;;
    anatomy)
      python3 scripts/gpu/step_anatomy.py --batches 1 64 256 --out "$OUT/anatomy_qwen3.md" || status=1
      python3 scripts/gpu/step_anatomy.py --model scripts/gpu/configs/llama-3.1-8b --batches 1 256 \
        --out "$OUT/anatomy_llama.md" || status=1 ;;
    install) ;;  # the install steps above only
    splits) python3 scripts/gpu/sweep_decode_splits.py --out "$OUT/splits.md" || status=1 ;;
    probe) python3 scripts/gpu/compile_parallelism.py > "$OUT/compile_probe.md" || status=1 ;;
    parity) python3 scripts/gpu/parity.py --jobs 6 --out "$OUT/parity.md" || status=1 ;;
    quant) python3 scripts/gpu/bench_quant.py --out "$OUT/quant.md" || status=1 ;;
    quant_cuda) python3 scripts/gpu/check_quant_cuda.py --out "$OUT/quant_cuda.md" || status=1 ;;
    structured)
      python3 scripts/bench_structured_output.py --device cuda --out "$OUT/structured.md" || status=1 ;;
    workloads) shift; python3 scripts/gpu/bench_workloads.py --out "$OUT/workloads.md" "$@" || status=1; break ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
  shift
done
exit $status
