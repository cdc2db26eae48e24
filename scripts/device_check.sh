#!/usr/bin/env bash
# One GPU-machine session: install, run the GPU tests, then the benchmarks named as
# arguments (default: the kernel benchmark). Logs and JSON go to $OUT (or ./out).
#   source .device/bootstrap.sh && bash scripts/device_check.sh [bench ...]
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1 \
  || { echo "pip install failed:"; tail -5 "$out/install.log"; exit 1; }
python3 -c "import torch, cutlass, graphstep.kernels; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'cutlass-dsl', cutlass.__version__)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -25
for bench in "${@:-kernels}"; do
  case "$bench" in
    kernels) python3 bench/bench_kernels.py --json "$out/kernels.json" 2>&1 | tee "$out/bench_kernels.log" ;;
    *) eval "$bench" 2>&1 | tee -a "$out/bench_other.log" ;;
  esac
done
